/*
 * mock_cuda.c - a stand-in libcuda.so.1 with the two driver calls the injector's attach watch makes
 * about contexts: one device whose primary context the test switches on.
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

/* graphs.c needs these to exist. Only the test graphs (0x6000 + K: K kernel nodes, node handles
 * 0x70000 + i) can be walked; any other graph answers "not supported". */
#define NOT_SUPPORTED 801
#include <stddef.h>
CUresult cuGraphGetNodes(void *g, void **nodes, size_t *n)
{
    unsigned long h = (unsigned long)g;
    if (h < 0x6000 || h >= 0x6100) return NOT_SUPPORTED;
    size_t k = h - 0x6000;
    if (nodes)
        for (size_t i = 0; i < k && i < *n; i++) nodes[i] = (void *)(0x70000ul + i);
    *n = k;
    return 0;
}
CUresult cuGraphNodeGetType(void *n, int *t)
{
    if ((unsigned long)n < 0x70000 || (unsigned long)n >= 0x70100) return NOT_SUPPORTED;
    *t = 0;   /* CU_GRAPH_NODE_TYPE_KERNEL */
    return 0;
}
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
#define MANAGED_LO 0x900000000000ull   /* managed memory: cuMemAllocManaged's and pool 0xbeef's addresses */
#define MANAGED_HI (MANAGED_LO + (1ull << 40))
CUresult cuPointerGetAttribute(void *d, int a, unsigned long long p)
{
    if (a == ATTR_IS_MANAGED && p >= MANAGED_LO && p < MANAGED_HI) {
        *(unsigned int *)d = 1;
        return 0;
    }
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

/* ---- the driver as the preloaded interposer sees it (interpose.c) ----
 * cuGetProcAddress_v2 answers from the table below (the per-thread twin under
 * CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM), as libcuda answers with its exports; the current context
 * is device mock_cuda_set_device(D)'s; launches, copies and graph launches succeed unless
 * mock_cuda_set_result(R) says otherwise, and count themselves (mock_cuda_calls()). Test graphs: a handle
 * 0x6000 + K is a graph of K kernel nodes (its exec: the handle + 0x1000). */
#include <string.h>

static atomic_int g_dev, g_result, g_calls;
void mock_cuda_set_device(int dev) { atomic_store(&g_dev, dev); }
void mock_cuda_set_result(int r) { atomic_store(&g_result, r); }
int mock_cuda_calls(void) { return atomic_load(&g_calls); }
static CUresult done(void) { atomic_fetch_add(&g_calls, 1); return atomic_load(&g_result); }

CUresult cuInit(unsigned int flags) { (void)flags; return 0; }
/* the current context: its own address per device, or one address for all after
 * mock_cuda_set_one_context_address(1) (a context destroyed and another made where it was) */
static atomic_int g_ctx_same;
void mock_cuda_set_one_context_address(int on) { atomic_store(&g_ctx_same, on); }
CUresult cuCtxGetCurrent(void **ctx)
{
    *ctx = (void *)(unsigned long)(0xc000 + (atomic_load(&g_ctx_same) ? 0 : atomic_load(&g_dev)));
    return 0;
}
CUresult cuCtxDestroy_v2(void *ctx) { (void)ctx; return 0; }
CUresult cuCtxGetDevice(CUdevice *dev) { *dev = atomic_load(&g_dev); return 0; }
CUresult cuCtxGetDevice_v2(CUdevice *dev, void *ctx) { *dev = (int)((unsigned long)ctx - 0xc000); return 0; }

/* ---- CUDA events (OTEL_GPU_CENSUS_ACTIVITY=events, events.c) ----
 * One GPU timeline on CLOCK_MONOTONIC: a successful kernel launch (a 2 us call) runs mock_cuda_set_kernel_ns(N) from
 * the call's end or when the work before it ends, whichever is later (a graph launch: mock_cuda_set_graph_ns(N)); an event
 * recorded takes the time the work before it ends, or now, and has fired once that time has passed. A pair's elapsed
 * time is the difference.
 *   mock_cuda_set_events_pending(1)  every query says "not ready" (work still running)
 *   mock_cuda_events_live()          events created and not destroyed
 *   mock_cuda_events_recorded()      cuEventRecord calls; mock_cuda_event_stream(): the stream of the last one
 *   mock_cuda_relaxed()              cuThreadExchangeStreamCaptureMode calls that asked for relaxed mode
 * A gate (cuStreamWaitValue32 on a word not yet at its value) holds the timeline: events and launches behind it are
 * placed from the moment a mock call first sees the word written (R), the GPU then meeting them back to back.
 *   mock_cuda_set_call_ns(N)         a launch call's own time (2,000 ns unless set)
 *   mock_cuda_set_event_ns(N)        the GPU's time to pass an event (0 unless set): a pair's reading holds it once
 *   mock_cuda_gates()                waits made on a shut word; mock_cuda_gate_opened_in_call(): a gate shut when
 *                                    a launch call began was opened during it (by someone else: the call was running) */
#include <stdlib.h>
#include <time.h>
#include <pthread.h>
#include <stdint.h>
static _Atomic unsigned long long g_gpu_free, g_kernel_ns, g_graph_ns, g_call_ns = 2000, g_event_ns;
static unsigned long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}
static unsigned long long after_work(void)
{
    unsigned long long t = now_ns(), f = atomic_load(&g_gpu_free);
    return f > t ? f : t;
}
static atomic_int g_ev_pending, g_ev_live, g_ev_recorded, g_relaxed, g_gates, g_opened_in_call;
static _Atomic(void *) g_ev_stream;
struct mock_event { unsigned long long t; int gate; };   /* gate: behind gate number `gate`, t its offset there */
/* the gate now shut: its word and value, the GPU's time when it reached it, the work queued behind it; R per gate */
static struct { volatile unsigned *word; unsigned val; unsigned long long at, behind; int id; } g_gate;
static unsigned long long g_gate_r[64];
static pthread_mutex_t g_gate_mu = PTHREAD_MUTEX_INITIALIZER;
static int gate_shut(void)   /* under g_gate_mu: the gate written since is opened, its time fixed */
{
    if (!g_gate.word) return 0;
    if (__atomic_load_n(g_gate.word, __ATOMIC_ACQUIRE) < g_gate.val) return 1;
    unsigned long long r = now_ns() > g_gate.at ? now_ns() : g_gate.at;
    g_gate_r[g_gate.id % 64] = r;
    atomic_store(&g_gpu_free, r + g_gate.behind);
    g_gate.word = NULL;
    return 0;
}
static int event_time(struct mock_event *e, unsigned long long *t)   /* 0: not known yet (behind a shut gate) */
{
    pthread_mutex_lock(&g_gate_mu);
    int shut = gate_shut();
    int known = !e->gate || !(shut && e->gate == g_gate.id);
    *t = e->gate ? g_gate_r[e->gate % 64] + e->t : e->t;
    pthread_mutex_unlock(&g_gate_mu);
    return known;
}
void mock_cuda_set_call_ns(unsigned long long ns) { atomic_store(&g_call_ns, ns); }
void mock_cuda_set_event_ns(unsigned long long ns) { atomic_store(&g_event_ns, ns); }
int mock_cuda_gates(void) { return atomic_load(&g_gates); }
int mock_cuda_gate_opened_in_call(void) { return atomic_load(&g_opened_in_call); }
CUresult cuStreamWaitValue32_v2(void *stream, unsigned long long addr, unsigned value, unsigned flags)
{
    (void)stream, (void)flags;   /* CU_STREAM_WAIT_VALUE_GEQ */
    pthread_mutex_lock(&g_gate_mu);
    if (!gate_shut() && *(volatile unsigned *)(uintptr_t)addr < value) {
        g_gate.word = (volatile unsigned *)(uintptr_t)addr;
        g_gate.val = value;
        g_gate.at = after_work();
        g_gate.behind = 0;
        g_gate.id++;
        atomic_fetch_add(&g_gates, 1);
    }
    pthread_mutex_unlock(&g_gate_mu);
    return 0;
}
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) { (void)p, (void)n, (void)flags; return 0; }
CUresult cuMemHostGetDevicePointer_v2(unsigned long long *d, void *p, unsigned flags)
{
    (void)flags;
    *d = (unsigned long long)(uintptr_t)p;   /* unified addressing: the host's address */
    return 0;
}
void mock_cuda_set_kernel_ns(unsigned long long ns) { atomic_store(&g_kernel_ns, ns); }
void mock_cuda_set_graph_ns(unsigned long long ns) { atomic_store(&g_graph_ns, ns); }
void mock_cuda_set_events_pending(int on) { atomic_store(&g_ev_pending, on); }
int mock_cuda_events_live(void) { return atomic_load(&g_ev_live); }
int mock_cuda_events_recorded(void) { return atomic_load(&g_ev_recorded); }
void *mock_cuda_event_stream(void) { return atomic_load(&g_ev_stream); }
int mock_cuda_relaxed(void) { return atomic_load(&g_relaxed); }
CUresult cuEventCreate(void **ev, unsigned int flags)
{
    (void)flags;
    *ev = calloc(1, sizeof(struct mock_event));
    if (!*ev) return 2;   /* CUDA_ERROR_OUT_OF_MEMORY */
    atomic_fetch_add(&g_ev_live, 1);
    return 0;
}
CUresult cuEventRecord(void *ev, void *stream)
{
    struct mock_event *e = ev;
    pthread_mutex_lock(&g_gate_mu);
    if (gate_shut()) {
        e->gate = g_gate.id;
        e->t = g_gate.behind += atomic_load(&g_event_ns);
    } else {
        e->gate = 0;
        e->t = after_work() + atomic_load(&g_event_ns);
        if (atomic_load(&g_event_ns)) atomic_store(&g_gpu_free, e->t);
    }
    pthread_mutex_unlock(&g_gate_mu);
    atomic_store(&g_ev_stream, stream);
    atomic_fetch_add(&g_ev_recorded, 1);
    return 0;
}
/* 600: CUDA_ERROR_NOT_READY */
CUresult cuEventQuery(void *ev)
{
    unsigned long long t;
    return atomic_load(&g_ev_pending) || !event_time(ev, &t) || t > now_ns() ? 600 : 0;
}
CUresult cuEventElapsedTime_v2(float *ms, void *a, void *b)
{
    unsigned long long ta, tb;
    if (!event_time(a, &ta) || !event_time(b, &tb)) return 600;
    *ms = (float)(((double)tb - (double)ta) / 1e6);
    return 0;
}
CUresult cuEventDestroy_v2(void *ev)
{
    free(ev);
    atomic_fetch_sub(&g_ev_live, 1);
    return 0;
}
CUresult cuCtxPushCurrent_v2(void *ctx) { (void)ctx; return 0; }
CUresult cuCtxPopCurrent_v2(void **ctx) { *ctx = NULL; return 0; }
CUresult cuThreadExchangeStreamCaptureMode(int *mode)
{
    if (*mode == 2) atomic_fetch_add(&g_relaxed, 1);   /* CU_STREAM_CAPTURE_MODE_RELAXED */
    *mode = 0;
    return 0;
}
/* A launch call takes 2 us, and its work reaches the GPU at the call's end (the doorbell), as on a real driver. */
static CUresult ran(unsigned long long ns)
{
    pthread_mutex_lock(&g_gate_mu);
    int shut = gate_shut();
    volatile unsigned *w = g_gate.word;
    unsigned v = g_gate.val;
    pthread_mutex_unlock(&g_gate_mu);
    for (unsigned long long t0 = now_ns(), call = atomic_load(&g_call_ns); now_ns() - t0 < call;) {}
    if (shut && __atomic_load_n(w, __ATOMIC_ACQUIRE) >= v) atomic_store(&g_opened_in_call, 1);
    CUresult r = done();
    pthread_mutex_lock(&g_gate_mu);
    if (r == 0 && gate_shut()) g_gate.behind += ns;
    else if (r == 0) atomic_store(&g_gpu_free, after_work() + ns);
    pthread_mutex_unlock(&g_gate_mu);
    return r;
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra)
{
    (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shared, (void)stream, (void)params,
        (void)extra;
    return ran(atomic_load(&g_kernel_ns));
}
CUresult cuLaunchKernel_ptsz(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                             unsigned shared, void *stream, void **params, void **extra)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
}
CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra)
{
    (void)config, (void)f, (void)params, (void)extra;
    return ran(atomic_load(&g_kernel_ns));
}
CUresult cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, void *stream)
{
    (void)dst, (void)src, (void)n, (void)stream;
    return done();
}
CUresult cuMemcpyHtoDAsync_v2_ptsz(unsigned long long dst, const void *src, size_t n, void *stream)
{
    return cuMemcpyHtoDAsync_v2(dst, src, n, stream);
}
CUresult cuMemcpyDtoH_v2(void *dst, unsigned long long src, size_t n) { (void)dst, (void)src, (void)n; return done(); }
CUresult cuMemcpyAsync(unsigned long long dst, unsigned long long src, size_t n, void *stream)
{
    (void)dst, (void)src, (void)n, (void)stream;
    return done();
}
CUresult cuMemsetD32Async(unsigned long long dst, unsigned int v, size_t n, void *stream)
{
    (void)dst, (void)v, (void)n, (void)stream;
    return done();
}
CUresult cuGraphInstantiateWithFlags(unsigned long *exec, unsigned long graph, unsigned long long flags)
{
    (void)flags;
    *exec = graph + 0x1000;
    return done();
}
CUresult cuGraphLaunch(unsigned long exec, void *stream) { (void)exec, (void)stream; return ran(atomic_load(&g_graph_ns)); }
CUresult cuGraphExecDestroy(unsigned long exec) { (void)exec; return done(); }
CUresult cuStreamBeginCapture_v2(unsigned long stream, int mode)
{
    (void)mode;
    mock_cuda_set_capturing(stream);
    return 0;
}
CUresult cuStreamEndCapture(unsigned long stream, void **graph)
{
    (void)stream;
    *graph = NULL;
    mock_cuda_set_capturing(0);
    return 0;
}

/* Batches and copies with attributes (their arguments are read by the census, not here); an array's descriptor:
 * the test arrays 0xa000 + K have K channels of float (4 bytes); cuMemcpyFutureAsync stands for a copy function of a
 * driver newer than the census. */
CUresult cuMemcpyBatchAsync_v2(void *dsts, void *srcs, void *sizes, size_t n, void *attrs, void *idx, size_t na,
                               void *stream)
{
    (void)dsts, (void)srcs, (void)sizes, (void)n, (void)attrs, (void)idx, (void)na, (void)stream;
    return done();
}
CUresult cuMemcpyBatchAsync(void *dsts, void *srcs, void *sizes, size_t n, void *attrs, void *idx, size_t na,
                            size_t *fail, void *stream)
{
    (void)fail;
    return cuMemcpyBatchAsync_v2(dsts, srcs, sizes, n, attrs, idx, na, stream);
}
CUresult cuMemcpy3DBatchAsync_v2(size_t n, void *ops, unsigned long long flags, void *stream)
{
    (void)n, (void)ops, (void)flags, (void)stream;
    return done();
}
CUresult cuMemcpy3DWithAttributesAsync(void *op, unsigned long long flags, void *stream)
{
    (void)op, (void)flags, (void)stream;
    return done();
}
CUresult cuMemcpyWithAttributesAsync(unsigned long long dst, unsigned long long src, size_t n, void *attr, void *stream)
{
    (void)dst, (void)src, (void)n, (void)attr, (void)stream;
    return done();
}
CUresult cuMemcpyFutureAsync(unsigned long long dst, unsigned long long src, size_t n, void *stream)
{
    (void)dst, (void)src, (void)n, (void)stream;
    return done();
}
/* Every other copy, memset and launch the census wraps: they only count themselves (the census reads their
 * arguments; an unspecified parameter list takes whatever the wrapper passes). */
#define WORK(name) CUresult name() { return done(); }
WORK(cuMemcpy) WORK(cuMemcpyHtoD_v2) WORK(cuMemcpyDtoD_v2) WORK(cuMemcpyDtoHAsync_v2) WORK(cuMemcpyDtoDAsync_v2)
WORK(cuMemcpyDtoA_v2) WORK(cuMemcpyAtoD_v2) WORK(cuMemcpyHtoA_v2) WORK(cuMemcpyAtoH_v2) WORK(cuMemcpyAtoA_v2)
WORK(cuMemcpy2D_v2) WORK(cuMemcpy2DUnaligned_v2) WORK(cuMemcpy2DAsync_v2) WORK(cuMemcpy3D_v2) WORK(cuMemcpy3DAsync_v2)
WORK(cuMemcpyPeer) WORK(cuMemcpyPeerAsync) WORK(cuMemcpy3DPeer) WORK(cuMemcpy3DPeerAsync)
WORK(cuMemsetD8_v2) WORK(cuMemsetD16_v2) WORK(cuMemsetD32_v2) WORK(cuMemsetD8Async) WORK(cuMemsetD16Async)
WORK(cuMemsetD2D8_v2) WORK(cuMemsetD2D16_v2) WORK(cuMemsetD2D32_v2) WORK(cuMemsetD2D32Async)
WORK(cuLaunchCooperativeKernel)
/* Managed memory: cuMemAllocManaged, and cuMemAllocFromPoolAsync from pool 0xbeef (a managed pool), hand out
 * addresses in [MANAGED_LO, MANAGED_HI), which cuPointerGetAttribute says are managed; any other pool's come from
 * the device range. Frees, advice and prefetches only count themselves. */
static _Atomic unsigned long long g_managed_next = MANAGED_LO, g_pool_next;
CUresult cuMemAllocManaged(unsigned long long *p, size_t n, unsigned int flags)
{
    (void)flags;
    *p = atomic_fetch_add(&g_managed_next, (n + 0xfffull) & ~0xfffull);
    return done();
}
CUresult cuMemAllocFromPoolAsync(unsigned long long *p, size_t n, unsigned long pool, void *stream)
{
    (void)stream;
    if (pool == 0xbeef) return cuMemAllocManaged(p, n, 1);
    *p = g_dev_lo + (1ull << 30) + atomic_fetch_add(&g_pool_next, (n + 0xfffull) & ~0xfffull);
    return done();
}
WORK(cuMemFree_v2) WORK(cuMemFreeAsync) WORK(cuMemAdvise_v2) WORK(cuMemPrefetchAsync_v2) WORK(cuMemPrefetchBatchAsync)
struct mock_array_desc { size_t w, h, d; int format; unsigned channels, flags; };
CUresult cuArray3DGetDescriptor_v2(struct mock_array_desc *desc, unsigned long a)
{
    if (a < 0xa000 || a >= 0xa010) return 1;
    desc->w = desc->h = desc->d = 0;
    desc->format = 0x20;    /* CU_AD_FORMAT_FLOAT */
    desc->channels = (unsigned)(a - 0xa000);
    desc->flags = 0;
    return 0;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status);
static const struct { const char *name; void *fn; } g_procs[] = {
    {"cuMemcpyBatchAsync", (void *)cuMemcpyBatchAsync_v2}, {"cuMemcpyBatchAsync@12080", (void *)cuMemcpyBatchAsync},
    {"cuMemcpy3DBatchAsync", (void *)cuMemcpy3DBatchAsync_v2},
    {"cuMemcpyWithAttributesAsync", (void *)cuMemcpyWithAttributesAsync},
    {"cuMemcpy3DWithAttributesAsync", (void *)cuMemcpy3DWithAttributesAsync},
    {"cuMemcpyFutureAsync", (void *)cuMemcpyFutureAsync},
#define PROC(name, sym) {name, (void *)sym},
    PROC("cuMemcpy", cuMemcpy) PROC("cuMemcpyHtoD", cuMemcpyHtoD_v2) PROC("cuMemcpyDtoD", cuMemcpyDtoD_v2)
    PROC("cuMemcpyDtoHAsync", cuMemcpyDtoHAsync_v2) PROC("cuMemcpyDtoDAsync", cuMemcpyDtoDAsync_v2)
    PROC("cuMemcpyDtoA", cuMemcpyDtoA_v2) PROC("cuMemcpyAtoD", cuMemcpyAtoD_v2) PROC("cuMemcpyHtoA", cuMemcpyHtoA_v2)
    PROC("cuMemcpyAtoH", cuMemcpyAtoH_v2) PROC("cuMemcpyAtoA", cuMemcpyAtoA_v2) PROC("cuMemcpy2D", cuMemcpy2D_v2)
    PROC("cuMemcpy2DUnaligned", cuMemcpy2DUnaligned_v2) PROC("cuMemcpy2DAsync", cuMemcpy2DAsync_v2)
    PROC("cuMemcpy3D", cuMemcpy3D_v2) PROC("cuMemcpy3DAsync", cuMemcpy3DAsync_v2) PROC("cuMemcpyPeer", cuMemcpyPeer)
    PROC("cuMemcpyPeerAsync", cuMemcpyPeerAsync) PROC("cuMemcpy3DPeer", cuMemcpy3DPeer)
    PROC("cuMemcpy3DPeerAsync", cuMemcpy3DPeerAsync) PROC("cuMemsetD8", cuMemsetD8_v2) PROC("cuMemsetD16", cuMemsetD16_v2)
    PROC("cuMemsetD32", cuMemsetD32_v2) PROC("cuMemsetD8Async", cuMemsetD8Async) PROC("cuMemsetD16Async", cuMemsetD16Async)
    PROC("cuMemsetD2D8", cuMemsetD2D8_v2) PROC("cuMemsetD2D16", cuMemsetD2D16_v2) PROC("cuMemsetD2D32", cuMemsetD2D32_v2)
    PROC("cuMemsetD2D32Async", cuMemsetD2D32Async) PROC("cuLaunchCooperativeKernel", cuLaunchCooperativeKernel)
    PROC("cuMemAllocManaged", cuMemAllocManaged) PROC("cuMemAllocFromPoolAsync", cuMemAllocFromPoolAsync)
    PROC("cuMemFree", cuMemFree_v2) PROC("cuMemFreeAsync", cuMemFreeAsync) PROC("cuMemAdvise", cuMemAdvise_v2) PROC("cuMemPrefetchAsync", cuMemPrefetchAsync_v2)
    PROC("cuMemPrefetchBatchAsync", cuMemPrefetchBatchAsync)
    {"cuInit", (void *)cuInit}, {"cuCtxGetCurrent", (void *)cuCtxGetCurrent},
    {"cuLaunchKernel", (void *)cuLaunchKernel}, {"cuLaunchKernel_ptsz", (void *)cuLaunchKernel_ptsz},
    {"cuLaunchKernelEx", (void *)cuLaunchKernelEx},
    {"cuMemcpyHtoDAsync", (void *)cuMemcpyHtoDAsync_v2}, {"cuMemcpyHtoDAsync_ptsz", (void *)cuMemcpyHtoDAsync_v2_ptsz},
    {"cuMemcpyDtoH", (void *)cuMemcpyDtoH_v2}, {"cuMemcpyAsync", (void *)cuMemcpyAsync},
    {"cuMemsetD32Async", (void *)cuMemsetD32Async},
    {"cuGraphInstantiate", (void *)cuGraphInstantiateWithFlags}, {"cuGraphLaunch", (void *)cuGraphLaunch},
    {"cuGraphExecDestroy", (void *)cuGraphExecDestroy}, {"cuStreamBeginCapture", (void *)cuStreamBeginCapture_v2},
    {"cuStreamEndCapture", (void *)cuStreamEndCapture}, {"cuGetProcAddress", (void *)cuGetProcAddress_v2},
    {"cuCtxDestroy", (void *)cuCtxDestroy_v2},
};
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status)
{
    char want[128];
    for (int pass = (flags & 2) ? 0 : 1; pass < 3; pass++) {   /* 2: CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM */
        strncpy(want, symbol, sizeof(want) - 16);
        want[sizeof(want) - 16] = 0;
        if (pass == 0) strcat(want, "_ptsz");
        if (pass == 1) {   /* as libcuda does: a CUDA version before 13.0 gets 12.8's batch functions */
            if (version >= 13000) continue;
            strcat(want, "@12080");
        }
        for (size_t i = 0; i < sizeof(g_procs) / sizeof(g_procs[0]); i++) {
            if (strcmp(want, g_procs[i].name) == 0) {
                *pfn = g_procs[i].fn;
                if (status) *status = 0;
                return 0;
            }
        }
    }
    *pfn = NULL;
    if (status) *status = 1;   /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return 500;                /* CUDA_ERROR_NOT_FOUND */
}
