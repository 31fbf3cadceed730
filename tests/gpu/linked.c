/* linked.c - a small library linked against libcuda (-lcuda), as vLLM's compiled ops are: it calls the driver's
 * copies directly and looks one up with cuGetProcAddress itself, so neither passes through anyone's dlsym.
 * coverage.cu's row linked_library loads it and calls linked_copies. */
#include <cuda.h>
#include <stddef.h>

int linked_copies(void *dev, void *dev2, void *pinned, void *pageable)
{
    if (cuMemcpyHtoD((CUdeviceptr)dev, pageable, 12345) != CUDA_SUCCESS) return 1;
    if (cuMemcpyDtoH(pinned, (CUdeviceptr)dev, 23457) != CUDA_SUCCESS) return 1;
    CUresult (*dtoh_async)(void *, CUdeviceptr, size_t, CUstream) = NULL;
    CUdriverProcAddressQueryResult q;
    if (cuGetProcAddress("cuMemcpyDtoHAsync", (void **)&dtoh_async, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &q) !=
            CUDA_SUCCESS || !dtoh_async)
        return 1;
    for (int i = 0; i < 3; i++)
        if (dtoh_async(pageable, (CUdeviceptr)dev2, 34567 + (size_t)i, NULL) != CUDA_SUCCESS) return 1;
    return cuCtxSynchronize() == CUDA_SUCCESS ? 0 : 1;
}
