/*
 * mock_cuda.c - a stand-in libcuda.so.1 with the two driver calls the injector's attach watch makes
 * (OTEL_GPU_CENSUS_ATTACH=context): one device whose primary context the test switches on.
 *   mock_cuda_set_active(1)   device 0's primary context is active from now on
 *   mock_cuda_polls()         how often the injector asked
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
