/*
 * mock_cupti.c - a stand-in libcupti for testing the injector on a machine without a GPU.
 *
 * It implements the single-subscriber activity API the injector resolves (no _v2 symbols, so the
 * injector takes its v1 path) and hands buffers back the way CUPTI does: the injector's request
 * callback supplies the buffer, the mock packs real record structs into it (the test passes bytes
 * built from the CUPTI headers), and the completion callback gets it back. Behaviour switches:
 *   MOCK_CUPTI_CONFLICT=1    cuptiSubscribe answers CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
 *   MOCK_CUPTI_ENABLE_FAIL=1 cuptiActivityEnable fails
 *   MOCK_CUPTI_COUNTED_ENABLE=1  a kind is on while it was enabled more often than disabled (a CUPTI that
 *                            counts them: a caller must not disable twice and enable once)
 *   MOCK_CUPTI_REENABLE_LOSES=1  CONCURRENT_KERNEL enabled globally again after a global disable keeps no
 *                            kernel record of contexts without a setting of their own (CUPTI 13.5, driver 580)
 *   MOCK_CUPTI_NO_CONTEXT_SWITCH=1  cuptiActivityEnableContext/DisableContext are refused
 *   MOCK_CUPTI_NO_UM=1       cuptiActivityConfigureUnifiedMemoryCounter answers UM_PROFILING_NOT_SUPPORTED (a GPU or
 *                            platform without unified-memory counters); mock_um_configured() says how many were set on
 *   MOCK_CUPTI_STACK_KB=N    cuptiActivityRegisterCallbacks first uses N KiB of its caller's stack, page by
 *                            page (set up on a live context, CUPTI and the driver need deep stacks:
 *                            llama-server segfaulted in libcuda on a 256 KiB thread stack)
 * Like CUPTI, it keeps no record of a kind that is not enabled when the record is queued ("launched").
 * cuptiFinalize detaches as CUPTI does: subscriber, callbacks, buffers and kinds gone; any later call attaches
 * again (mock_finalizes counts them; mock_subscribed says whether a subscriber holds the slot).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cupti.h>

static CUpti_BuffersCallbackRequestFunc g_req;
static CUpti_BuffersCallbackCompleteFunc g_done;
static size_t g_dropped;
static int g_enabled[64];
static uint64_t g_ext_stack[64];
static int g_ext_depth;
static int g_flushes;

/* Records queued by the test, waiting for a flush: sizes and bytes back to back. */
static uint8_t g_pending[1 << 20];
static size_t g_pending_len;
static int g_outstanding_max;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* the injector's flusher flushes too */

static int env_on(const char *name)
{
    const char *v = getenv(name);
    return v && *v == '1';
}

CUptiResult cuptiGetVersion(uint32_t *v) { *v = 130099; return CUPTI_SUCCESS; }

CUptiResult cuptiGetResultString(CUptiResult r, const char **s)
{
    *s = r == CUPTI_SUCCESS ? "CUPTI_SUCCESS" : "CUPTI_ERROR (mock)";
    return CUPTI_SUCCESS;
}

/* A CUPTI-like clock that moves (kernel sampling schedules on it): the epoch-ish origin the tests
 * use for record timestamps plus CLOCK_MONOTONIC since the first call. */
CUptiResult cuptiGetTimestamp(uint64_t *ts)
{
    static uint64_t mono0;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    uint64_t now = (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
    if (!mono0) mono0 = now;
    *ts = 1700000000000000000ull + (now - mono0);
    return CUPTI_SUCCESS;
}

/* The callback API, as far as steps use it: one subscriber with a callback, callbacks enabled per
 * (domain, id), names for a few real ids of the CUPTI headers. */
static CUpti_CallbackFunc g_api_cb;
static void *g_api_ud;
static int g_subscribed;
static unsigned char g_cb_on[3][4096];  /* runtime, driver, resource */

CUptiResult cuptiSubscribe(CUpti_SubscriberHandle *s, CUpti_CallbackFunc cb, void *u)
{
    if (env_on("MOCK_CUPTI_CONFLICT")) return CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
    /* MOCK_CUPTI_SLOT_TAKEN=1: a profiler subscribed after our probe gave the slot back */
    if (cb && env_on("MOCK_CUPTI_SLOT_TAKEN")) return CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
    if (g_subscribed) return CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
    g_subscribed = 1;
    g_api_cb = cb;
    g_api_ud = u;
    *s = (CUpti_SubscriberHandle)(uintptr_t)1;
    return CUPTI_SUCCESS;
}

CUptiResult cuptiUnsubscribe(CUpti_SubscriberHandle s)
{
    (void)s;
    g_subscribed = 0;
    g_api_cb = NULL;
    memset(g_cb_on, 0, sizeof(g_cb_on));
    return CUPTI_SUCCESS;
}

static int cb_domain(CUpti_CallbackDomain d)
{
    return d == CUPTI_CB_DOMAIN_RUNTIME_API ? 0 : d == CUPTI_CB_DOMAIN_DRIVER_API ? 1 :
           d == CUPTI_CB_DOMAIN_RESOURCE ? 2 : -1;
}

CUptiResult cuptiGetCallbackName(CUpti_CallbackDomain d, uint32_t cbid, const char **name)
{
    static const struct { int dom; uint32_t id; const char *name; } known[] = {
        {0, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000, "cudaLaunchKernel"},
        {0, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_v3020, "cudaMemcpyAsync"},
        {0, CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_v3020, "cudaMemsetAsync"},
        {0, CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000, "cudaGraphLaunch"},
        {0, CUPTI_RUNTIME_TRACE_CBID_cudaGraphAddMemcpyNode_v10000, "cudaGraphAddMemcpyNode"},
        {0, CUPTI_RUNTIME_TRACE_CBID_cudaGetDevice_v3020, "cudaGetDevice"},
        {0, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchHostFunc_v10000, "cudaLaunchHostFunc"},
        {0, CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCapture_v10000, "cudaStreamBeginCapture"},
        {0, CUPTI_RUNTIME_TRACE_CBID_cudaStreamEndCapture_v10000, "cudaStreamEndCapture"},
        {1, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel, "cuLaunchKernel"},
        {1, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx, "cuLaunchKernelEx"},
        {1, CUPTI_DRIVER_TRACE_CBID_cuLaunchHostFunc, "cuLaunchHostFunc"},
        {1, CUPTI_DRIVER_TRACE_CBID_cuCtxGetCurrent, "cuCtxGetCurrent"},
        {1, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch, "cuGraphLaunch"},
        /* copies and memsets, as OTEL_GPU_CENSUS_ACTIVITY=off counts them */
        {1, CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2, "cuMemcpyHtoDAsync_v2"},
        {1, CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz, "cuMemcpyHtoDAsync_v2_ptsz"},
        {1, CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2, "cuMemcpyDtoH_v2"},
        {1, CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync, "cuMemcpyAsync"},
        {1, CUPTI_DRIVER_TRACE_CBID_cuMemcpy3DAsync_v2, "cuMemcpy3DAsync_v2"},
        {1, CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async, "cuMemsetD32Async"},
        {1, CUPTI_DRIVER_TRACE_CBID_cuMemsetD2D8_v2, "cuMemsetD2D8_v2"},
        {1, CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_v2, "cuMemcpyBatchAsync_v2"},
        {1, CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD, "cuMemcpyHtoD"},   /* v1: 32-bit pointers, not followed */
    };
    int dom = cb_domain(d);
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        if (known[i].dom == dom && known[i].id == cbid) {
            *name = known[i].name;
            return CUPTI_SUCCESS;
        }
    if (dom < 0 || dom > 1 || cbid >= 4096) return CUPTI_ERROR_INVALID_PARAMETER;
    *name = dom == 0 ? "cudaSomethingElse" : "cuSomethingElse";
    return CUPTI_SUCCESS;
}

CUptiResult cuptiEnableCallback(uint32_t enable, CUpti_SubscriberHandle s, CUpti_CallbackDomain d, CUpti_CallbackId cbid)
{
    (void)s;
    int dom = cb_domain(d);
    if (!g_subscribed || dom < 0 || cbid >= 4096) return CUPTI_ERROR_INVALID_PARAMETER;
    g_cb_on[dom][cbid] = enable ? 1 : 0;
    return CUPTI_SUCCESS;
}

CUptiResult cuptiEnableDomain(uint32_t enable, CUpti_SubscriberHandle s, CUpti_CallbackDomain d)
{
    (void)s;
    int dom = cb_domain(d);
    if (!g_subscribed || dom < 0) return CUPTI_ERROR_INVALID_PARAMETER;
    memset(g_cb_on[dom], enable ? 1 : 0, sizeof(g_cb_on[dom]));
    return CUPTI_SUCCESS;
}

/* One 4 KiB frame a level, each touched: a stack too small faults on its guard page. */
static __attribute__((noinline)) int deep(int pages)
{
    volatile char frame[4096];
    memset((char *)frame, pages, sizeof(frame));
    return pages > 1 ? deep(pages - 1) + frame[7] : frame[7];
}

CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc r, CUpti_BuffersCallbackCompleteFunc c)
{
    const char *kb = getenv("MOCK_CUPTI_STACK_KB");
    if (kb && atoi(kb) > 0) (void)deep(atoi(kb) / 4);
    g_req = r;
    g_done = c;
    return CUPTI_SUCCESS;
}

/* CUPTI 13.5 on driver 580: once CONCURRENT_KERNEL was disabled globally, enabling it globally again gives
 * contexts without a setting of their own no more eager kernel records (MOCK_CUPTI_REENABLE_LOSES=1). */
static int g_kernel_lost;

CUptiResult cuptiActivityEnable(CUpti_ActivityKind k)
{
    if (env_on("MOCK_CUPTI_ENABLE_FAIL")) return CUPTI_ERROR_NOT_COMPATIBLE;
    if ((int)k >= 0 && (int)k < 64) g_enabled[k] = env_on("MOCK_CUPTI_COUNTED_ENABLE") ? g_enabled[k] + 1 : 1;
    return CUPTI_SUCCESS;
}

CUptiResult cuptiActivityDisable(CUpti_ActivityKind k)
{
    if ((int)k >= 0 && (int)k < 64) g_enabled[k] = env_on("MOCK_CUPTI_COUNTED_ENABLE") ? g_enabled[k] - 1 : 0;
    if (k == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && env_on("MOCK_CUPTI_REENABLE_LOSES")) g_kernel_lost = 1;
    return CUPTI_SUCCESS;
}

/* Per-context settings supersede the global one, for contexts 1..8 (device d's is d + 1); -1: none.
 * MOCK_CUPTI_NO_CONTEXT_SWITCH=1: CUPTI refuses them. */
static int g_ctx_kind[9][64];
static int g_ctx_set[9];     /* the context has settings of its own */
static int g_ctx_calls, g_ctx_calls_of[9];

static CUptiResult ctx_set(CUcontext c, CUpti_ActivityKind k, int on)
{
    uintptr_t i = (uintptr_t)c;
    if (env_on("MOCK_CUPTI_NO_CONTEXT_SWITCH")) return CUPTI_ERROR_NOT_SUPPORTED;
    if (i < 1 || i > 8 || (int)k < 0 || (int)k >= 64) return CUPTI_ERROR_INVALID_CONTEXT;
    if (!g_ctx_set[i]) { /* first setting: none for the other kinds */
        for (int j = 0; j < 64; j++) g_ctx_kind[i][j] = -1;
        g_ctx_set[i] = 1;
    }
    g_ctx_kind[i][k] = on;
    g_ctx_calls++;
    g_ctx_calls_of[i]++;
    return CUPTI_SUCCESS;
}

CUptiResult cuptiActivityEnableContext(CUcontext c, CUpti_ActivityKind k) { return ctx_set(c, k, 1); }
CUptiResult cuptiActivityDisableContext(CUcontext c, CUpti_ActivityKind k) { return ctx_set(c, k, 0); }

/* Is `kind` traced for context `ctx` (1..8; 0: no context)? */
static int traced(int kind, uintptr_t ctx)
{
    if (kind < 0 || kind >= 64) return 0;
    if (ctx >= 1 && ctx <= 8 && g_ctx_set[ctx] && g_ctx_kind[ctx][kind] >= 0)
        return g_ctx_kind[ctx][kind];
    if (kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && g_kernel_lost) return 0;
    return g_enabled[kind] > 0;
}

CUptiResult cuptiActivityFlushPeriod(uint32_t ms) { (void)ms; return CUPTI_SUCCESS; }

/* Records in a mock buffer: [uint32 size][pad 4][record bytes, size rounded up to 8] ... */
CUptiResult cuptiActivityGetNextRecord(uint8_t *buf, size_t valid, CUpti_Activity **rec)
{
    size_t off = 0;
    if (*rec) {
        off = (size_t)((uint8_t *)*rec - buf);
        uint32_t sz;
        memcpy(&sz, buf + off - 8, 4);
        off += ((sz + 7) & ~7u) + 8; /* past this record and the next one's size header */
    } else {
        off = 8;
    }
    if (off >= valid) return CUPTI_ERROR_MAX_LIMIT_REACHED;
    *rec = (CUpti_Activity *)(buf + off);
    return CUPTI_SUCCESS;
}

CUptiResult cuptiActivityGetNumDroppedRecords(CUcontext c, uint32_t s, size_t *d)
{
    (void)c; (void)s;
    *d = g_dropped;
    g_dropped = 0;
    return CUPTI_SUCCESS;
}

CUptiResult cuptiActivityPushExternalCorrelationId(CUpti_ExternalCorrelationKind k, uint64_t id)
{
    (void)k;
    if (g_ext_depth >= 64) return CUPTI_ERROR_INVALID_OPERATION;
    g_ext_stack[g_ext_depth++] = id;
    return CUPTI_SUCCESS;
}

CUptiResult cuptiActivityPopExternalCorrelationId(CUpti_ExternalCorrelationKind k, uint64_t *id)
{
    (void)k;
    if (g_ext_depth == 0) return CUPTI_ERROR_QUEUE_EMPTY;
    *id = g_ext_stack[--g_ext_depth];
    return CUPTI_SUCCESS;
}

/* Deliver queued records: ask the injector for buffers, fill, complete (as CUPTI's flush does). */
CUptiResult cuptiActivityFlushAll(uint32_t flag)
{
    (void)flag;
    pthread_mutex_lock(&g_lock);
    g_flushes++;
    size_t done = 0;
    while (done < g_pending_len && g_req && g_done) {
        uint8_t *buf = NULL;
        size_t size = 0, maxrec = 0;
        g_req(&buf, &size, &maxrec);
        if (!buf || size == 0) { /* refused: CUPTI drops what it cannot store */
            g_dropped += 1;
            done = g_pending_len;
            break;
        }
        size_t used = 0;
        while (done < g_pending_len) {
            uint32_t sz;
            memcpy(&sz, g_pending + done, 4);
            size_t need = 8 + ((sz + 7) & ~7u);
            if (used + need > size) break;
            memcpy(buf + used, g_pending + done, need);
            used += need;
            done += need;
        }
        g_done(NULL, 0, buf, size, used);
    }
    g_pending_len = 0;
    pthread_mutex_unlock(&g_lock);
    return CUPTI_SUCCESS;
}

/* CUPTI's dynamic detach: everything set up is gone; records still queued go with it. */
static int g_finalizes;
CUptiResult cuptiFinalize(void)
{
    pthread_mutex_lock(&g_lock);
    g_pending_len = 0;
    pthread_mutex_unlock(&g_lock);
    g_subscribed = 0;
    g_api_cb = NULL;
    memset(g_cb_on, 0, sizeof(g_cb_on));
    memset(g_enabled, 0, sizeof(g_enabled));
    g_req = NULL;
    g_done = NULL;
    g_finalizes++;
    return CUPTI_SUCCESS;
}

static int g_um_configured;
CUptiResult cuptiActivityConfigureUnifiedMemoryCounter(CUpti_ActivityUnifiedMemoryCounterConfig *c, uint32_t n)
{
    if (env_on("MOCK_CUPTI_NO_UM")) return CUPTI_ERROR_UM_PROFILING_NOT_SUPPORTED;
    g_um_configured = 0;
    for (uint32_t i = 0; i < n; i++) g_um_configured += c[i].enable != 0;
    return CUPTI_SUCCESS;
}
int mock_um_configured(void) { return g_um_configured; }

/* ---- test controls ---- */
int mock_finalizes(void) { return g_finalizes; }
int mock_subscribed(void) { return g_subscribed; }

int mock_queue_record(const void *rec, uint32_t size)
{
    size_t need = 8 + ((size + 7) & ~7u);
    CUpti_ActivityKind kind = ((const CUpti_Activity *)rec)->kind;
    uintptr_t ctx = 1;   /* a kernel record's context is its device's; other kinds: device 0's */
    if (kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) ctx = ((const CUpti_ActivityKernel13 *)rec)->deviceId + 1;
    if ((int)kind >= 0 && (int)kind < 64 && !traced(kind, ctx)) return 1; /* not traced */
    pthread_mutex_lock(&g_lock);
    if (g_pending_len + need > sizeof(g_pending)) {
        pthread_mutex_unlock(&g_lock);
        return -1;
    }
    memset(g_pending + g_pending_len, 0, need);
    memcpy(g_pending + g_pending_len, &size, 4);
    memcpy(g_pending + g_pending_len + 8, rec, size);
    g_pending_len += need;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

void mock_set_dropped(size_t n) { g_dropped = n; }
/* whether records of `kind` from device 0's context would be kept now */
int mock_enabled(int kind) { return traced(kind, 1); }
int mock_enabled_globally(int kind) { return kind >= 0 && kind < 64 ? g_enabled[kind] > 0 : 0; }
int mock_context_calls(void) { return g_ctx_calls; }
int mock_context_calls_of(int ctx) { return ctx >= 1 && ctx <= 8 ? g_ctx_calls_of[ctx] : 0; }
/* whether records of `kind` from context `ctx` (1..8) would be kept now */
int mock_enabled_in(int kind, int ctx) { return traced(kind, (uintptr_t)ctx); }
int mock_flushes(void) { return g_flushes; }
int mock_registered(void) { return g_req != NULL && g_done != NULL; }
uint64_t mock_ext_top(void) { return g_ext_depth ? g_ext_stack[g_ext_depth - 1] : 0; }
int mock_outstanding_max(void) { return g_outstanding_max; }
int mock_callback_enabled(int dom, uint32_t cbid) { return dom >= 0 && dom < 2 && cbid < 4096 && g_cb_on[dom][cbid]; }

/* The context API calls report (device d's is (CUcontext)(d + 1); 0: none) and what they return. */
static __thread int t_api_device;
static __thread int t_api_result;
static __thread uintptr_t t_api_stream;
void mock_set_api_device(int dev_plus_one) { t_api_device = dev_plus_one; }
void mock_set_api_result(int r) { t_api_result = r; }
/* The stream of the launches that follow (0: the default), in the parameters CUPTI passes with a
 * runtime launch (cudaLaunchKernel_v7000_params: func, gridDim, blockDim, args, sharedMem, stream)
 * and a driver launch (cuLaunchKernel_params: f, 7 unsigned ints, hStream, ...). */
void mock_set_api_stream(uintptr_t stream) { t_api_stream = stream; }
struct rt_params { const void *func; unsigned grid[3], block[3]; void **args; size_t shared; uintptr_t stream; };
struct drv_params { void *f; unsigned dims[7]; uintptr_t stream; void **params, **extra; };

CUptiResult cuptiGetDeviceId(CUcontext ctx, uint32_t *dev)
{
    if (!ctx) return CUPTI_ERROR_INVALID_CONTEXT;
    *dev = (uint32_t)((uintptr_t)ctx - 1);
    return CUPTI_SUCCESS;
}

/* An API call by the calling thread, as the driver reports it to a subscriber: 1 when a callback ran.
 * A runtime launch runs a driver launch inside it when inner_cbid is not 0 (reported if enabled). */
static int api_call(int dom, uint32_t cbid, uint32_t corr, uint32_t inner_cbid, const void *params)
{
    if (!mock_callback_enabled(dom, cbid) || !g_api_cb) /* the call runs all the same, its inner one too */
        return inner_cbid ? api_call(1, inner_cbid, corr + 1, 0, NULL) : 0;
    CUpti_CallbackData data;
    memset(&data, 0, sizeof(data));
    int result = t_api_result;
    data.correlationId = corr;
    data.context = (CUcontext)(uintptr_t)t_api_device;
    data.contextUid = (uint32_t)t_api_device;
    data.functionReturnValue = &result;
    struct rt_params rt = {.stream = t_api_stream};
    struct drv_params drv = {.stream = t_api_stream};
    data.functionParams = params ? params : dom == 0 ? (const void *)&rt : (const void *)&drv;
    CUpti_CallbackDomain d = dom == 0 ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API;
    data.callbackSite = CUPTI_API_ENTER;
    g_api_cb(g_api_ud, d, cbid, &data);
    if (inner_cbid) (void)api_call(1, inner_cbid, corr + 1, 0, NULL);
    data.callbackSite = CUPTI_API_EXIT;
    g_api_cb(g_api_ud, d, cbid, &data);
    return 1;
}

int mock_api_call(int dom, uint32_t cbid, uint32_t corr) { return api_call(dom, cbid, corr, 0, NULL); }
/* The same with the call's own parameters (the driver's copy calls: their layouts are the test's). */
int mock_api_call_params(int dom, uint32_t cbid, uint32_t corr, const void *params)
{
    return api_call(dom, cbid, corr, 0, params);
}

/* A resource event (CUPTI_CBID_RESOURCE_CONTEXT_CREATED, ..._DESTROY_STARTING) for context `ctx`, as CUPTI
 * reports it to a subscriber that enabled it: 1 when a callback ran. */
int mock_resource_call(uint32_t cbid, int ctx)
{
    if (cbid >= 4096 || !g_cb_on[2][cbid] || !g_api_cb) return 0;
    CUpti_ResourceData r;
    memset(&r, 0, sizeof(r));
    r.context = (CUcontext)(uintptr_t)ctx;
    g_api_cb(g_api_ud, CUPTI_CB_DOMAIN_RESOURCE, cbid, &r);
    return 1;
}
int mock_api_call_nested(int dom, uint32_t cbid, uint32_t corr, uint32_t inner_cbid)
{
    return api_call(dom, cbid, corr, inner_cbid, NULL);
}

/* Ask for buffers without returning them, as CUPTI does when many threads launch at once. */
int mock_hold_buffers(int n)
{
    int got = 0;
    for (int i = 0; i < n && g_req; i++) {
        uint8_t *buf = NULL;
        size_t size = 0, maxrec = 0;
        g_req(&buf, &size, &maxrec);
        if (buf) got++;
    }
    return got;
}
