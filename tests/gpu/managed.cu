// managed.cu - a known migration pattern of managed memory, for the census's managed-memory test
// (test_managed_gpu.py). 8 MiB of managed memory:
//   1. written on the host (its pages populated there: nothing migrates);
//   2. a kernel touches the first 6 MiB: the driver migrates them host-to-device;
//   3. the host reads the first 4 MiB: those migrate device-to-host;
//   4. the last 2 MiB, still on the host, are prefetched to the device (cudaMemPrefetchAsync): host-to-device.
// So 8 MiB move host-to-device and 4 MiB device-to-host, each within the driver's page granularity; no copy call
// names any of it. Prints the sum it read (so nothing is optimised away). Exit 77: this GPU has no concurrent
// managed access (the pattern would differ), else 0.
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(x)                                                                                                         \
    do {                                                                                                              \
        cudaError_t e_ = (x);                                                                                         \
        if (e_ != cudaSuccess) {                                                                                      \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));                       \
            exit(1);                                                                                                  \
        }                                                                                                             \
    } while (0)

static const size_t MiB = 1 << 20, TOTAL = 8 * MiB, ON_GPU = 6 * MiB, BACK = 4 * MiB;

__global__ void touch(unsigned char *p, size_t n)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] += 1;
}

int main(void)
{
    int dev = 0, concurrent = 0;
    CK(cudaSetDevice(dev));
    CK(cudaDeviceGetAttribute(&concurrent, cudaDevAttrConcurrentManagedAccess, dev));
    if (!concurrent) return 77;
    unsigned char *p = NULL;
    CK(cudaMallocManaged(&p, TOTAL));
    memset(p, 1, TOTAL);                                                    // 1. on the host
    touch<<<(unsigned)((ON_GPU + 255) / 256), 256>>>(p, ON_GPU);            // 2. the device touches 6 MiB
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    unsigned long long sum = 0;
    for (size_t i = 0; i < BACK; i += 64) sum += p[i];                      // 3. the host reads 4 MiB back
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
#if CUDART_VERSION >= 13000
    cudaMemLocation loc;
    memset(&loc, 0, sizeof(loc));
    loc.type = cudaMemLocationTypeDevice;
    loc.id = dev;
    CK(cudaMemPrefetchAsync(p + ON_GPU, TOTAL - ON_GPU, loc, 0, s));        // 4. the last 2 MiB prefetched
#else
    CK(cudaMemPrefetchAsync(p + ON_GPU, TOTAL - ON_GPU, dev, s));
#endif
    CK(cudaStreamSynchronize(s));
    CK(cudaFree(p));
    printf("sum %llu\n", sum);
    return 0;
}
