// coverage.cu - one way of putting work on the GPU per row, each row in a process of its own, so that a row's
// census (default: counted at the calls; precise: CUPTI's records) can be set against the other to the byte and the
// count. Sizes are odd so that no two rows' figures can stand in for each other. Usage: coverage ROW (`coverage list`
// prints the rows); exit 0 when the row ran, 77 when this driver lacks what it needs (the row is skipped), else 1.
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
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
#define CU(x)                                                                                                         \
    do {                                                                                                              \
        CUresult r_ = (x);                                                                                            \
        if (r_ != CUDA_SUCCESS) {                                                                                     \
            fprintf(stderr, "%s:%d %s: CUresult %d\n", __FILE__, __LINE__, #x, (int)r_);                             \
            exit(1);                                                                                                  \
        }                                                                                                             \
    } while (0)

__global__ void add1(float *p, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] += 1.0f;
}

static const size_t A = 1000003, B = 77777, C = 4099;   // odd sizes, bytes
static float *dev, *dev2;
static unsigned char *pinned, *pageable;
static cudaStream_t s;

static void setup(void)
{
    CK(cudaSetDevice(0));
    CK(cudaMalloc(&dev, 4 * A));
    CK(cudaMalloc(&dev2, 4 * A));
    CK(cudaMallocHost(&pinned, 4 * A));
    pageable = (unsigned char *)malloc(4 * A);
    memset(pageable, 1, 4 * A);
    memset(pinned, 2, 4 * A);
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
}

// a driver function through cuGetProcAddress at a CUDA version (0: this toolkit's), NULL where the driver lacks it
static void *proc(const char *name, int version)
{
    void *p = NULL;
    CUdriverProcAddressQueryResult q;
    if (cuGetProcAddress(name, &p, version ? version : CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &q) != CUDA_SUCCESS ||
        q != CU_GET_PROC_ADDRESS_SUCCESS)
        return NULL;
    return p;
}

static int row_kernel_runtime(void)
{
    for (int i = 0; i < 7; i++) add1<<<(int)(C + 255) / 256, 256, 0, s>>>(dev, (int)C);
    return 0;
}

static int row_kernel_driver(void)
{
    cudaFunction_t f;
    CK(cudaGetFuncBySymbol(&f, (const void *)add1));
    int n = (int)C;
    void *args[] = {&dev, &n};
    for (int i = 0; i < 5; i++) CU(cuLaunchKernel((CUfunction)f, 17, 1, 1, 256, 1, 1, 0, (CUstream)s, args, NULL));
    return 0;
}

static int row_kernel_ex(void)
{
    cudaFunction_t f;
    CK(cudaGetFuncBySymbol(&f, (const void *)add1));
    int n = (int)C;
    void *args[] = {&dev, &n};
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.gridDimX = 17, cfg.gridDimY = cfg.gridDimZ = 1, cfg.blockDimX = 256, cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.hStream = (CUstream)s;
    for (int i = 0; i < 3; i++) CU(cuLaunchKernelEx(&cfg, (CUfunction)f, args, NULL));
    cudaLaunchConfig_t rc;
    memset(&rc, 0, sizeof(rc));
    rc.gridDim = dim3(17), rc.blockDim = dim3(256), rc.stream = s;
    for (int i = 0; i < 2; i++) CK(cudaLaunchKernelEx(&rc, add1, dev, n));
    return 0;
}

static int row_kernel_cooperative(void)
{
    int n = (int)C;
    void *args[] = {&dev, &n};
    for (int i = 0; i < 3; i++) CK(cudaLaunchCooperativeKernel((const void *)add1, dim3(4), dim3(256), args, 0, s));
    cudaFunction_t f;
    CK(cudaGetFuncBySymbol(&f, (const void *)add1));
    CU(cuLaunchCooperativeKernel((CUfunction)f, 4, 1, 1, 256, 1, 1, 0, (CUstream)s, args));
    return 0;
}

static int row_copy_sync(void)
{
    CK(cudaMemcpy(dev, pageable, A, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dev, pageable, B, cudaMemcpyDefault));
    CK(cudaMemcpy(dev, pinned, B, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(pageable, dev, C, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(pinned, dev, A, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(dev2, dev, B, cudaMemcpyDeviceToDevice));
    CU(cuMemcpyHtoD((CUdeviceptr)dev, pageable, C + 2));
    CU(cuMemcpyDtoH(pinned, (CUdeviceptr)dev, C + 4));
    CU(cuMemcpyDtoD((CUdeviceptr)dev2, (CUdeviceptr)dev, C + 6));
    CU(cuMemcpy((CUdeviceptr)dev2, (CUdeviceptr)pinned, C + 8));
    return 0;
}

static int row_copy_async(void)
{
    CK(cudaMemcpyAsync(dev, pageable, A, cudaMemcpyHostToDevice, s));
    CK(cudaMemcpyAsync(dev, pinned, B, cudaMemcpyHostToDevice, s));
    CK(cudaMemcpyAsync(pageable, dev, C, cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(pinned, dev, A, cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(dev2, dev, B, cudaMemcpyDeviceToDevice, s));
    CK(cudaMemcpyAsync(dev2, dev, C, cudaMemcpyDefault, s));
    CU(cuMemcpyHtoDAsync((CUdeviceptr)dev, pinned, C + 2, (CUstream)s));
    CU(cuMemcpyDtoHAsync(pinned, (CUdeviceptr)dev, C + 4, (CUstream)s));
    CU(cuMemcpyDtoDAsync((CUdeviceptr)dev2, (CUdeviceptr)dev, C + 6, (CUstream)s));
    CU(cuMemcpyAsync((CUdeviceptr)pinned, (CUdeviceptr)dev, C + 8, (CUstream)s));
    return 0;
}

static int row_copy_2d(void)
{
    CK(cudaMemcpy2D(dev, 2048, pageable, 1031, 1031, 37, cudaMemcpyHostToDevice));
    CK(cudaMemcpy2D(pinned, 1031, dev, 2048, 1031, 41, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy2DAsync(dev2, 2048, dev, 2048, 999, 43, cudaMemcpyDeviceToDevice, s));
    CK(cudaMemcpy2DAsync(dev, 2048, pinned, 1031, 1031, 47, cudaMemcpyHostToDevice, s));
    return 0;
}

static int row_copy_3d(void)
{
    cudaMemcpy3DParms p;
    memset(&p, 0, sizeof(p));
    p.srcPtr = make_cudaPitchedPtr(pageable, 1031, 1031, 13);
    p.dstPtr = make_cudaPitchedPtr(dev, 2048, 1031, 13);
    p.extent = make_cudaExtent(1031, 13, 7);
    p.kind = cudaMemcpyHostToDevice;
    CK(cudaMemcpy3D(&p));
    p.srcPtr = make_cudaPitchedPtr(dev, 2048, 1031, 13);
    p.dstPtr = make_cudaPitchedPtr(pinned, 1031, 1031, 13);
    p.extent = make_cudaExtent(1031, 11, 5);
    p.kind = cudaMemcpyDeviceToHost;
    CK(cudaMemcpy3DAsync(&p, s));
    return 0;
}

static int row_copy_array(void)
{
    cudaChannelFormatDesc d = cudaCreateChannelDesc<float>();
    cudaArray_t a;
    CK(cudaMallocArray(&a, &d, 257, 33));
    CK(cudaMemcpy2DToArray(a, 0, 0, pageable, 257 * 4, 257 * 4, 31, cudaMemcpyHostToDevice));
    CK(cudaMemcpy2DFromArray(pinned, 257 * 4, a, 0, 0, 257 * 4, 29, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy2DToArrayAsync(a, 0, 0, dev, 2048, 255 * 4, 27, cudaMemcpyDeviceToDevice, s));
    CK(cudaStreamSynchronize(s));
    CK(cudaFreeArray(a));
    return 0;
}

static int row_copy_peer(void)
{
    CK(cudaMemcpyPeer(dev2, 0, dev, 0, B));
    CK(cudaMemcpyPeerAsync(dev2, 0, dev, 0, C, s));
    return 0;
}

static int row_memset(void)
{
    CK(cudaMemset(dev, 0, A));
    CK(cudaMemsetAsync(dev, 1, B, s));
    CK(cudaMemset2D(dev, 2048, 3, 1031, 17));
    CK(cudaMemset2DAsync(dev, 2048, 4, 999, 19, s));
    cudaExtent e = make_cudaExtent(1031, 7, 3);
    CK(cudaMemset3D(make_cudaPitchedPtr(dev, 2048, 1031, 7), 5, e));
    CU(cuMemsetD8((CUdeviceptr)dev, 1, C));
    CU(cuMemsetD16((CUdeviceptr)dev, 1, C));
    CU(cuMemsetD32((CUdeviceptr)dev, 1, C));
    CU(cuMemsetD8Async((CUdeviceptr)dev, 1, C + 2, (CUstream)s));
    CU(cuMemsetD16Async((CUdeviceptr)dev, 1, C + 4, (CUstream)s));
    CU(cuMemsetD32Async((CUdeviceptr)dev, 1, C + 6, (CUstream)s));
    CU(cuMemsetD2D8((CUdeviceptr)dev, 2048, 1, 1031, 5));
    CU(cuMemsetD2D16((CUdeviceptr)dev, 2048, 1, 511, 5));
    CU(cuMemsetD2D32((CUdeviceptr)dev, 2048, 1, 255, 5));
    CU(cuMemsetD2D32Async((CUdeviceptr)dev, 2048, 1, 251, 3, (CUstream)s));
    return 0;
}

static int row_batch_runtime(void)
{
    void *dsts[4] = {dev, pageable + 64, pinned + 128, dev2};
    const void *srcs[4] = {pinned, dev, dev2, dev};
    size_t sizes[4] = {B, C, A, C + 10};
    cudaMemcpyAttributes at;
    memset(&at, 0, sizeof(at));
    at.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t idx = 0;
    for (int i = 0; i < 3; i++) CK(cudaMemcpyBatchAsync(dsts, srcs, sizes, 4, &at, &idx, 1, s));
    return 0;
}

typedef CUresult (*batch_v1_fn)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *, size_t,
                                size_t *, CUstream);
typedef CUresult (*batch_v2_fn)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *, size_t,
                                CUstream);

static int row_batch_driver(void)
{
    batch_v1_fn v1 = (batch_v1_fn)proc("cuMemcpyBatchAsync", 12080);   // 12.8's, as an older library asks
    batch_v2_fn v2 = (batch_v2_fn)proc("cuMemcpyBatchAsync", 13000);
    if (!v1 || !v2) return 77;
    CUdeviceptr dsts[3] = {(CUdeviceptr)pinned, (CUdeviceptr)dev, (CUdeviceptr)pageable};
    CUdeviceptr srcs[3] = {(CUdeviceptr)dev, (CUdeviceptr)pageable, (CUdeviceptr)dev2};
    size_t sizes[3] = {262144 + 7, B, C};
    CUmemcpyAttributes at;
    memset(&at, 0, sizeof(at));
    at.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    size_t idx = 0, fail = 0;
    CU(v1(dsts, srcs, sizes, 3, &at, &idx, 1, &fail, (CUstream)s));
    CU(v2(dsts, srcs, sizes, 3, &at, &idx, 1, (CUstream)s));
    CU(v2(dsts, srcs, sizes, 2, &at, &idx, 1, (CUstream)s));
    return 0;
}

static int row_batch_3d(void)
{
    CUDA_MEMCPY3D_BATCH_OP ops[2];
    memset(ops, 0, sizeof(ops));
    for (int i = 0; i < 2; i++) {
        ops[i].src.type = ops[i].dst.type = CU_MEMCPY_OPERAND_TYPE_POINTER;
        ops[i].srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    }
    ops[0].src.op.ptr.ptr = (CUdeviceptr)dev, ops[0].dst.op.ptr.ptr = (CUdeviceptr)pinned;
    ops[0].extent.width = 1031, ops[0].extent.height = 3, ops[0].extent.depth = 2;
    ops[1].src.op.ptr.ptr = (CUdeviceptr)pageable, ops[1].dst.op.ptr.ptr = (CUdeviceptr)dev2;
    ops[1].extent.width = 999, ops[1].extent.height = 1, ops[1].extent.depth = 1;
    for (int i = 0; i < 2; i++) CU(cuMemcpy3DBatchAsync(2, ops, 0, (CUstream)s));
    return 0;
}

static int row_graph(void)
{
    cudaGraph_t g;
    cudaGraphExec_t x;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    add1<<<17, 256, 0, s>>>(dev, (int)C);
    CK(cudaMemcpyAsync(dev, pinned, B, cudaMemcpyHostToDevice, s));
    CK(cudaMemsetAsync(dev2, 0, C, s));
    add1<<<17, 256, 0, s>>>(dev2, (int)C);
    CK(cudaMemcpyAsync(pinned, dev, C, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&x, g, 0));
    for (int i = 0; i < 4; i++) CK(cudaGraphLaunch(x, s));
    CK(cudaStreamSynchronize(s));
    CK(cudaGraphExecDestroy(x));
    CK(cudaGraphDestroy(g));
    return 0;
}

// A library linked against libcuda (built beside this program, see the test): it calls the driver directly and
// looks functions up with cuGetProcAddress itself, as vLLM's compiled ops do.
static int row_linked_library(void)
{
    const char *path = getenv("COVERAGE_LINKED_LIB");
    void *h = path ? dlopen(path, RTLD_NOW) : NULL;
    if (!h) {
        fprintf(stderr, "coverage: COVERAGE_LINKED_LIB: %s\n", dlerror());
        return 1;
    }
    int (*copies)(void *, void *, void *, void *) = (int (*)(void *, void *, void *, void *))dlsym(h, "linked_copies");
    if (!copies || copies(dev, dev2, pinned, pageable) != 0) return 1;
    return 0;
}

static const struct { const char *name; int (*fn)(void); } ROWS[] = {
    {"kernel_runtime", row_kernel_runtime}, {"kernel_driver", row_kernel_driver}, {"kernel_ex", row_kernel_ex},
    {"kernel_cooperative", row_kernel_cooperative}, {"copy_sync", row_copy_sync}, {"copy_async", row_copy_async},
    {"copy_2d", row_copy_2d}, {"copy_3d", row_copy_3d}, {"copy_array", row_copy_array}, {"copy_peer", row_copy_peer},
    {"memset", row_memset}, {"batch_runtime", row_batch_runtime}, {"batch_driver", row_batch_driver},
    {"batch_3d", row_batch_3d}, {"graph", row_graph}, {"linked_library", row_linked_library},
};

int main(int argc, char **argv)
{
    if (argc != 2) return 2;
    for (size_t i = 0; i < sizeof(ROWS) / sizeof(ROWS[0]); i++) {
        if (strcmp(argv[1], "list") == 0) {
            printf("%s\n", ROWS[i].name);
            continue;
        }
        if (strcmp(argv[1], ROWS[i].name) != 0) continue;
        setup();
        int rc = ROWS[i].fn();
        CK(cudaDeviceSynchronize());
        return rc;
    }
    return strcmp(argv[1], "list") == 0 ? 0 : 2;
}
