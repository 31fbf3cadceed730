/*
 * mock_cuda.c - a stand-in libcuda.so.1 with the two driver calls the injector's attach watch makes
 * (OTEL_GPU_CENSUS_ATTACH=context): one device whose primary context the test switches on.
 *   mock_cuda_set_active(1)   device 0's primary context is active from now on
 *   mock_cuda_polls()         how often the injector asked
 *   mock_cuda_set_capturing(S) stream S (a handle value; 0: none) captures from now on
 * and the graph queries graphs.c resolves (no graph is ever walked here: each answers "not supported"),
 * so that graphs are counted per launch as with a real driver.
 * Built with the soname libcuda.so.1 and loaded RTLD_GLOBAL first, so that the injector's
 * dlopen("libcuda.so.1", RTLD_NOLOAD) finds it as it finds the real driver.
 */
#include <stdatomic.h>

typedef int CUresult;
typedef int CUdevice;

static atomic_int g_active, g_polls;

CUresult cuDeviceGetCount(int *n)
{
    *n = 1;
    return 0;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    atomic_fetch_add(&g_polls, 1);
    *flags = 0;
    *active = dev == 0 && atomic_load(&g_active);
    return 0;
}

void mock_cuda_set_active(int on) { atomic_store(&g_active, on); }
int mock_cuda_polls(void) { return atomic_load(&g_polls); }

/* the device's UUID (the injector names devices in the segment): 16 bytes of 0xa0 + ordinal */
CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
    *dev = ordinal;
    return ordinal == 0 ? 0 : 101;   /* CUDA_ERROR_INVALID_DEVICE */
}
CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice dev)
{
    for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0xa0 + dev);
    return 0;
}

/* graphs.c needs these to exist; the mock has no graphs to walk */
#define NOT_SUPPORTED 801
CUresult cuGraphGetNodes(void *g, void *nodes, void *n) { (void)g; (void)nodes; (void)n; return NOT_SUPPORTED; }
CUresult cuGraphNodeGetType(void *n, void *t) { (void)n; (void)t; return NOT_SUPPORTED; }
CUresult cuGraphMemcpyNodeGetParams(void *n, void *p) { (void)n; (void)p; return NOT_SUPPORTED; }
CUresult cuGraphMemsetNodeGetParams(void *n, void *p) { (void)n; (void)p; return NOT_SUPPORTED; }
CUresult cuGraphChildGraphNodeGetGraph(void *n, void *g) { (void)n; (void)g; return NOT_SUPPORTED; }
/* cuPointerGetAttribute: device memory of device 0 and pinned host memory where the test says (none by
 * default); any other pointer is pageable host memory, which the driver does not know. */
static _Atomic unsigned long long g_dev_lo, g_dev_hi, g_pin_lo, g_pin_hi;
void mock_cuda_set_memory(unsigned long long dev_lo, unsigned long long dev_hi, unsigned long long pin_lo,
                          unsigned long long pin_hi)
{
    g_dev_lo = dev_lo;
    g_dev_hi = dev_hi;
    g_pin_lo = pin_lo;
    g_pin_hi = pin_hi;
}
enum { ATTR_MEMORY_TYPE = 2, ATTR_IS_MANAGED = 8, ATTR_DEVICE_ORDINAL = 9, MEMORYTYPE_HOST = 1, MEMORYTYPE_DEVICE = 2 };
CUresult cuPointerGetAttribute(void *d, int a, unsigned long long p)
{
    int dev = p >= g_dev_lo && p < g_dev_hi, pin = p >= g_pin_lo && p < g_pin_hi;
    if (!dev && !pin) return NOT_SUPPORTED;
    switch (a) {
    case ATTR_MEMORY_TYPE: *(unsigned int *)d = dev ? MEMORYTYPE_DEVICE : MEMORYTYPE_HOST; return 0;
    case ATTR_IS_MANAGED: *(unsigned int *)d = 0; return 0;
    case ATTR_DEVICE_ORDINAL: *(int *)d = 0; return 0;
    default: return NOT_SUPPORTED;
    }
}

/* cuStreamIsCapturing: the one stream the test says captures */
static _Atomic unsigned long g_capturing;
void mock_cuda_set_capturing(unsigned long stream) { atomic_store(&g_capturing, stream); }
CUresult cuStreamIsCapturing(void *stream, int *status)
{
    unsigned long c = atomic_load(&g_capturing);
    *status = c && (unsigned long)stream == c;   /* CU_STREAM_CAPTURE_STATUS_ACTIVE = 1 */
    return 0;
}
