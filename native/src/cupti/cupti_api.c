/*
 * cupti_api.c - CUPTI resolved at run time (dlopen), behind one set of calls for both of its APIs.
 *
 * v2 (CUPTI >= 13.2) lets torch.profiler or Nsight subscribe beside us; v1 allows one subscriber per
 * process, so there we only probe (and give the slot back) unless steps need API callbacks.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "cupti_api.h"
#include "internal.h"

static struct {
    int v2;
    CUpti_SubscriberHandle sub;     /* v2: ours for the process's life; v1: only once callbacks are on */
    CUptiResult (*get_version)(uint32_t *);
    CUptiResult (*result_string)(CUptiResult, const char **);
    CUptiResult (*get_timestamp)(uint64_t *);
    CUptiResult (*get_timestamp_v2)(CUpti_SubscriberHandle, uint64_t *);
    CUptiResult (*subscribe)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *);
    CUptiResult (*unsubscribe)(CUpti_SubscriberHandle);
    CUptiResult (*subscribe_v2)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *, CUpti_SubscriberParams *);
    CUptiResult (*enable_callback)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain, CUpti_CallbackId);
    CUptiResult (*callback_name)(CUpti_CallbackDomain, uint32_t, const char **);
    CUptiResult (*register_cb)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc);
    CUptiResult (*register_cb_v2)(CUpti_SubscriberHandle, CUpti_BuffersCallbackRequestFunc_v2, CUpti_BuffersCallbackCompleteFunc_v2);
    CUptiResult (*enable)(CUpti_ActivityKind);
    CUptiResult (*enable_v2)(CUpti_SubscriberHandle, CUpti_ActivityKind, CUpti_ActivityConfig *);
    CUptiResult (*disable)(CUpti_ActivityKind);
    CUptiResult (*disable_v2)(CUpti_SubscriberHandle, CUpti_ActivityKind, CUpti_ActivityConfig *);
    CUptiResult (*enable_context)(CUcontext, CUpti_ActivityKind);
    CUptiResult (*disable_context)(CUcontext, CUpti_ActivityKind);
    CUptiResult (*next_record)(uint8_t *, size_t, CUpti_Activity **);
    CUptiResult (*next_record_v2)(CUpti_SubscriberHandle, uint8_t *, size_t, CUpti_Activity **);
    CUptiResult (*dropped)(CUcontext, uint32_t, size_t *);
    CUptiResult (*dropped_v2)(CUpti_SubscriberHandle, CUcontext, uint32_t, size_t *);
    CUptiResult (*flush_all)(uint32_t);
    CUptiResult (*flush_period)(uint32_t);
    CUptiResult (*device_id)(CUcontext, uint32_t *);
    CUptiResult (*um_configure)(CUpti_ActivityUnifiedMemoryCounterConfig *, uint32_t);
} cu;

/* gc_cupti_load succeeded: the activity API is resolved (a census counting through the preloaded interposer never
 * loads CUPTI, and every call below then answers NOT_INITIALIZED). */
#define LOADED (cu.flush_all != NULL)

/* The v2 buffer callbacks carry extra info we do not need: adapt them to the v1 shapes. */
static CUpti_BuffersCallbackRequestFunc g_req;
static CUpti_BuffersCallbackCompleteFunc g_done;
static _Atomic(CUpti_CallbackFunc) g_api_cb;    /* the injector's dispatcher (steps, graphs) */

static void CUPTIAPI on_api(void *ud, CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const void *data)
{
    CUpti_CallbackFunc f = atomic_load_explicit(&g_api_cb, memory_order_acquire);
    if (f) f(ud, dom, cbid, data);
}

const char *gc_cupti_error(CUptiResult r)
{
    const char *s = NULL;
    if (cu.result_string && cu.result_string(r, &s) == CUPTI_SUCCESS && s) return s;
    return "unknown CUPTI error";
}

#define RESOLVE(field, name) (*(void **)&cu.field = dlsym(lib, name))

int gc_cupti_load(const char *path)
{
    /* A libcupti already loaded (torch links one) must be the one we use: one per process. */
    void *lib = dlopen("libcupti.so.13", RTLD_NOW | RTLD_NOLOAD);
    if (!lib && path && *path) {
        /* a path the user named and that does not load is an error, not a hint */
        lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            const char *why = dlerror();
            gc_log("census off: cannot load OTEL_GPU_CENSUS_CUPTI=%s: %s", path, why ? why : "?");
            return -1;
        }
    }
    if (!lib) lib = dlopen("libcupti.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        gc_log("census off: libcupti.so.13 not found; install nvidia-cuda-cupti or set OTEL_GPU_CENSUS_CUPTI");
        return -1;
    }
    RESOLVE(get_version, "cuptiGetVersion");
    RESOLVE(result_string, "cuptiGetResultString");
    RESOLVE(get_timestamp, "cuptiGetTimestamp");
    RESOLVE(get_timestamp_v2, "cuptiGetTimestamp_v2");
    RESOLVE(subscribe, "cuptiSubscribe");
    RESOLVE(unsubscribe, "cuptiUnsubscribe");
    RESOLVE(subscribe_v2, "cuptiSubscribe_v2");
    RESOLVE(enable_callback, "cuptiEnableCallback");
    RESOLVE(callback_name, "cuptiGetCallbackName");
    RESOLVE(register_cb, "cuptiActivityRegisterCallbacks");
    RESOLVE(register_cb_v2, "cuptiActivityRegisterCallbacks_v2");
    RESOLVE(enable, "cuptiActivityEnable");
    RESOLVE(enable_v2, "cuptiActivityEnable_v2");
    RESOLVE(disable, "cuptiActivityDisable");
    RESOLVE(disable_v2, "cuptiActivityDisable_v2");
    RESOLVE(enable_context, "cuptiActivityEnableContext");
    RESOLVE(disable_context, "cuptiActivityDisableContext");
    RESOLVE(next_record, "cuptiActivityGetNextRecord");
    RESOLVE(next_record_v2, "cuptiActivityGetNextRecord_v2");
    RESOLVE(dropped, "cuptiActivityGetNumDroppedRecords");
    RESOLVE(dropped_v2, "cuptiActivityGetNumDroppedRecords_v2");
    RESOLVE(flush_all, "cuptiActivityFlushAll");
    RESOLVE(flush_period, "cuptiActivityFlushPeriod");
    RESOLVE(device_id, "cuptiGetDeviceId");
    RESOLVE(um_configure, "cuptiActivityConfigureUnifiedMemoryCounter");
    if (!cu.register_cb || !cu.enable || !cu.disable || !cu.next_record || !cu.dropped || !cu.flush_all ||
        !cu.flush_period) {
        gc_log("census off: the loaded libcupti lacks the activity API");
        return -1;
    }
    return 0;
}

static int have_v2(void)
{
    return cu.subscribe_v2 && cu.register_cb_v2 && cu.enable_v2 && cu.disable_v2 && cu.next_record_v2 &&
           cu.dropped_v2;
}

int gc_cupti_subscribe(int want_v1)
{
    CUptiResult r;
    if (!want_v1 && have_v2()) {
        char other[CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN + 1] = {0};
        CUpti_SubscriberParams p;
        memset(&p, 0, sizeof(p));
        p.structSize = CUpti_SubscriberParams_STRUCT_SIZE;
        p.subscriberName = "otel-gpu-census";
        p.oldSubscriberName = other;
        p.oldSubscriberSize = sizeof(other) - 1;
        p.allowMultipleSubscribers = 1;
        /* on_api reaches only the callbacks enabled later (graphs at start, steps at the first step) */
        r = cu.subscribe_v2(&cu.sub, on_api, NULL, &p);
        if (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) {
            gc_log("census off: CUPTI is in use by %s, which does not share it; the server runs "
                   "without census", other[0] ? other : "another tool");
            return -1;
        }
        if (r == CUPTI_SUCCESS) {
            cu.v2 = 1;
            return 0;
        }
        /* anything else: fall back to the single-subscriber API below */
    }
    if (cu.subscribe && cu.unsubscribe) {
        /* Probe only: Nsight and friends hold the subscriber slot. Do not keep it ourselves,
         * so that a later torch.profiler can still subscribe. */
        CUpti_SubscriberHandle probe;
        r = cu.subscribe(&probe, NULL, NULL);
        if (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) {
            gc_log("census off: another CUPTI client (Nsight, a profiler) holds CUPTI; the server "
                   "runs without census");
            return -1;
        }
        if (r == CUPTI_SUCCESS) cu.unsubscribe(probe);
    }
    return 0;
}

int gc_cupti_is_v2(void) { return cu.v2; }

int gc_cupti_downgrade_v1(void)
{
    if (!cu.v2) return 0;
    if (cu.unsubscribe) cu.unsubscribe(cu.sub);
    cu.v2 = 0;
    cu.sub = NULL;
    return gc_cupti_subscribe(1);
}

uint32_t gc_cupti_version(void)
{
    uint32_t v = 0;
    if (cu.get_version) cu.get_version(&v);
    return v;
}

static void CUPTIAPI on_request_v2(uint8_t **buffer, size_t *size, size_t *max_records,
                                   CUpti_BufferCallbackRequestInfo *info)
{
    (void)info;
    g_req(buffer, size, max_records);
}

static void CUPTIAPI on_complete_v2(uint8_t *buffer, size_t size, size_t valid, CUpti_BufferCallbackCompleteInfo *info)
{
    (void)info;
    g_done(NULL, 0, buffer, size, valid);
}

CUptiResult gc_cupti_register(CUpti_BuffersCallbackRequestFunc req, CUpti_BuffersCallbackCompleteFunc done)
{
    g_req = req;
    g_done = done;
    if (!LOADED) return CUPTI_ERROR_NOT_INITIALIZED;
    return cu.v2 ? cu.register_cb_v2(cu.sub, on_request_v2, on_complete_v2) : cu.register_cb(req, done);
}

CUptiResult gc_cupti_enable(CUpti_ActivityKind k)
{
    if (!LOADED) return CUPTI_ERROR_NOT_INITIALIZED;
    return cu.v2 ? cu.enable_v2(cu.sub, k, NULL) : cu.enable(k);
}

CUptiResult gc_cupti_disable(CUpti_ActivityKind k)
{
    if (!LOADED) return CUPTI_ERROR_NOT_INITIALIZED;
    return cu.v2 ? cu.disable_v2(cu.sub, k, NULL) : cu.disable(k);
}

CUptiResult gc_cupti_kernels_context(CUcontext ctx, int on)
{
    CUptiResult (*f)(CUcontext, CUpti_ActivityKind) = on ? cu.enable_context : cu.disable_context;
    return f ? f(ctx, CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) : CUPTI_ERROR_NOT_SUPPORTED;
}

CUptiResult gc_cupti_next_record(uint8_t *buffer, size_t valid, CUpti_Activity **record)
{
    if (!LOADED) return CUPTI_ERROR_NOT_INITIALIZED;
    return cu.v2 ? cu.next_record_v2(cu.sub, buffer, valid, record) : cu.next_record(buffer, valid, record);
}

CUptiResult gc_cupti_dropped(CUcontext ctx, uint32_t stream, size_t *dropped)
{
    if (!LOADED) return CUPTI_ERROR_NOT_INITIALIZED;
    return cu.v2 ? cu.dropped_v2(cu.sub, ctx, stream, dropped) : cu.dropped(ctx, stream, dropped);
}

CUptiResult gc_cupti_flush_all(uint32_t flag) { return LOADED ? cu.flush_all(flag) : CUPTI_ERROR_NOT_INITIALIZED; }
CUptiResult gc_cupti_flush_period(uint32_t ms) { return LOADED ? cu.flush_period(ms) : CUPTI_ERROR_NOT_INITIALIZED; }

uint64_t gc_cupti_timestamp(CUptiResult *why)
{
    uint64_t ts = 0;
    CUptiResult r = CUPTI_ERROR_NOT_INITIALIZED;
    /* Under the v2 API (measured with libcupti 13.5) the legacy cuptiGetTimestamp fails: ask as our
     * subscriber. */
    if (cu.v2 && cu.get_timestamp_v2 && (r = cu.get_timestamp_v2(cu.sub, &ts)) != CUPTI_SUCCESS) ts = 0;
    if (!ts && cu.get_timestamp && (r = cu.get_timestamp(&ts)) != CUPTI_SUCCESS) ts = 0;
    if (why) *why = r;
    return ts;
}

void gc_cupti_set_api_callback(CUpti_CallbackFunc cb)
{
    atomic_store_explicit(&g_api_cb, cb, memory_order_release);
}

/* v1 has one subscriber slot: callbacks need it for the process's life. Called with `mu` held. */
static int callback_subscriber(const char *who)
{
    static int state; /* 0 untried, 1 subscribed (or v2), -1 failed */
    if (state) return state;
    state = -1;
    if (!cu.enable_callback || !cu.callback_name) {
        gc_log("%s: the loaded libcupti lacks the callback API", who);
        return state;
    }
    if (!cu.v2) {
        CUptiResult r = cu.subscribe ? cu.subscribe(&cu.sub, on_api, NULL) : CUPTI_ERROR_NOT_INITIALIZED;
        if (r != CUPTI_SUCCESS) {
            gc_log("%s: cannot subscribe to CUPTI callbacks (%s); another tool may hold CUPTI's one "
                   "subscriber slot", who, gc_cupti_error(r));
            return state;
        }
    }
    return state = 1;
}

static pthread_mutex_t g_cb_mu = PTHREAD_MUTEX_INITIALIZER;

/* Who wants each runtime and driver callback (GC_CB_* bits): one is on while anybody wants it, so the
 * launch counter can switch its own off (a paused census, a runtime launch the driver reports too)
 * without taking them from steps or graphs. Under g_cb_mu. */
static uint8_t g_cb_owners[2][GC_API_CBIDS];

int gc_cupti_enable_api(const char *who, int owner,
                        int (*want)(CUpti_CallbackDomain, CUpti_CallbackId, const char *))
{
    int enabled = 0;
    pthread_mutex_lock(&g_cb_mu);
    if (callback_subscriber(who) < 0) {
        pthread_mutex_unlock(&g_cb_mu);
        return -1;
    }
    static const struct { CUpti_CallbackDomain dom; uint32_t n; } domains[] = {
        {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_SIZE},
        {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_SIZE},
    };
    for (int d = 0; d < 2; d++) {
        for (uint32_t id = 1; id < domains[d].n && id < (uint32_t)GC_API_CBIDS; id++) {
            const char *name = NULL;
            /* an older libcupti knows fewer ids: those fail here and are skipped */
            if (cu.callback_name(domains[d].dom, id, &name) != CUPTI_SUCCESS || !name) continue;
            if (want(domains[d].dom, id, name) && cu.enable_callback(1, cu.sub, domains[d].dom, id) == CUPTI_SUCCESS) {
                g_cb_owners[d][id] |= (uint8_t)owner;
                enabled++;
            }
        }
    }
    pthread_mutex_unlock(&g_cb_mu);
    if (!enabled) gc_log("%s: CUPTI enabled none of the callbacks", who);
    return enabled;
}

int gc_cupti_enable_resource(const char *who, CUpti_CallbackId cbid)
{
    pthread_mutex_lock(&g_cb_mu);
    int ok = callback_subscriber(who) > 0 &&
             cu.enable_callback(1, cu.sub, CUPTI_CB_DOMAIN_RESOURCE, cbid) == CUPTI_SUCCESS;
    pthread_mutex_unlock(&g_cb_mu);
    return ok ? 0 : -1;
}

CUptiResult gc_cupti_device_of(CUcontext ctx, uint32_t *dev)
{
    return cu.device_id ? cu.device_id(ctx, dev) : CUPTI_ERROR_NOT_INITIALIZED;
}

CUptiResult gc_cupti_um_configure(void)
{
    if (!LOADED) return CUPTI_ERROR_NOT_INITIALIZED;
    if (!cu.um_configure) return CUPTI_ERROR_NOT_SUPPORTED;
    static const CUpti_ActivityUnifiedMemoryCounterKind kinds[] = {
        CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_HTOD,
        CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_DTOH,
        CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_DTOD,
        CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_CPU_PAGE_FAULT_COUNT,
        CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_GPU_PAGE_FAULT,
        CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_THRASHING,
        CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_THROTTLING,
        CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_REMOTE_MAP,
    };
    enum { N = sizeof(kinds) / sizeof(kinds[0]), BYTES = 2 };   /* the first BYTES: the migrations themselves */
    CUpti_ActivityUnifiedMemoryCounterConfig c[N];
    memset(c, 0, sizeof(c));
    for (int i = 0; i < N; i++) {
        c[i].scope = CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_SCOPE_PROCESS_SINGLE_DEVICE;
        c[i].kind = kinds[i];
        c[i].enable = 1;
    }
    /* a platform without fault or thrashing reports refuses the whole set: then the bytes each way alone */
    CUptiResult r = cu.um_configure(c, N);
    return r == CUPTI_SUCCESS ? r : cu.um_configure(c, BYTES);
}
