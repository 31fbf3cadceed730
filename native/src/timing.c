/*
 * timing.c - kernel durations from windows of CUPTI, for a census whose counts are the preloaded library's own
 * (OTEL_GPU_CENSUS_ACTIVITY=windows).
 *
 * Counting at the calls without CUPTI costs next to nothing but measures no duration. Here CUPTI is
 * set up at the schedule's first on-phase with two kinds: CONCURRENT_KERNEL (eager kernels: the sample that
 * prices every counted launch) and GRAPH_TRACE (one record per graph launch: its span, which prices every launch
 * of the same exec), both switched off between windows. The flusher thread does it all; CUPTI's clock is read
 * against CLOCK_REALTIME (the census clock) at the set-up so every record is moved onto it.
 *
 * The design detached CUPTI between windows, because its activity API, once set up, costs every launch
 * until cuptiFinalize: kinds off, a forced flush, then cuptiFinalize at the exit callsite of the process's
 * next driver call (CUPTI's documented dynamic detach), the flusher never waiting for it. With driver 580 and
 * CUPTI 13.5 every CUDA-graph program died at its next GPU work after that. So by default CUPTI
 * stays set up and only the kinds are switched; OTEL_GPU_CENSUS_WINDOWS_PROBE=detach keeps the detach as a
 * diagnostic.
 *
 * Never a lock in a CUPTI callback. Records that would reach the sink from cuptiFinalize itself (none should:
 * the kinds were off and flushed first) are dropped, so the finalizing thread, whoever it is, takes no lock.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <cupti.h>

#include "gpu_census.h"
#include "internal.h"

#define T_BUFFER (1u << 20)    /* bytes a buffer */
#define T_BUFFERS 32           /* at most outstanding: memory bounded at 32 MiB; past it CUPTI drops records */

enum { T_IDLE = 0, T_ON, T_DETACHING, T_OFF };          /* T_OFF: never again (failed, stopped, a child) */
enum { D_NONE = 0, D_ASKED, D_FINALIZING, D_DONE };    /* the detach, as the finalizing callback moves it */

static struct {
    void *lib;
    CUptiResult (*subscribe)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *);
    CUptiResult (*enable_callback)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain, CUpti_CallbackId);
    CUptiResult (*enable_domain)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain);
    CUptiResult (*register_cb)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc);
    CUptiResult (*enable)(CUpti_ActivityKind);
    CUptiResult (*disable)(CUpti_ActivityKind);
    CUptiResult (*next_record)(uint8_t *, size_t, CUpti_Activity **);
    CUptiResult (*flush_all)(uint32_t);
    CUptiResult (*finalize)(void);
    CUptiResult (*timestamp)(uint64_t *);
    CUptiResult (*result_string)(CUptiResult, const char **);
} cu;

static struct {
    const char *path;
    gc_timing_sink sink;
    int more;                    /* windows may open again (0: stopped, or CUPTI refused one) */
    int state;                   /* T_*: the flusher's (and exit's), under mu */
    CUpti_SubscriberHandle sub;
    uint64_t since;              /* monotonic ns the attach or detach began */
    pthread_mutex_t mu;
} tm = {.mu = PTHREAD_MUTEX_INITIALIZER, .state = T_OFF};

/* Read by the injector under its own lock, which the sink takes under tm.mu: atomics, never tm.mu. */
static struct { _Atomic uint64_t windows, failed, attach_ns, detach_ns; } g_st;
static atomic_int g_detach;              /* D_*: the callbacks read it */
/* Detaching crashes CUDA-graph workloads (driver 580, CUPTI 13.5: an illegal memory access or a launch failure
 * at the first launches after cuptiFinalize, with or without GRAPH_TRACE, one thread or five). So CUPTI stays set up after the first window and only the two kinds are switched.
 * OTEL_GPU_CENSUS_WINDOWS_PROBE (a diagnostic, not a mode): "detach" detaches between windows as designed above,
 * "nograph" leaves GRAPH_TRACE off: which part of a window a failure needs. */
static int g_no_graph, g_no_detach = 1;
static _Atomic int64_t g_wall_minus_cupti;
static atomic_int g_outstanding;

static const char *err(CUptiResult r)
{
    const char *s = NULL;
    return cu.result_string && cu.result_string(r, &s) == CUPTI_SUCCESS && s ? s : "unknown CUPTI error";
}

#define RESOLVE(field, name) (*(void **)&cu.field = dlsym(lib, name))

static int load(void)
{
    void *lib = dlopen("libcupti.so.13", RTLD_NOW | RTLD_NOLOAD); /* one already loaded (torch's) wins */
    if (!lib && tm.path && *tm.path) lib = dlopen(tm.path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcupti.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        gc_log("kernel time not measured: libcupti.so.13 not found (OTEL_GPU_CENSUS_CUPTI); counts are exact");
        return -1;
    }
    RESOLVE(subscribe, "cuptiSubscribe");
    RESOLVE(enable_callback, "cuptiEnableCallback");
    RESOLVE(enable_domain, "cuptiEnableDomain");
    RESOLVE(register_cb, "cuptiActivityRegisterCallbacks");
    RESOLVE(enable, "cuptiActivityEnable");
    RESOLVE(disable, "cuptiActivityDisable");
    RESOLVE(next_record, "cuptiActivityGetNextRecord");
    RESOLVE(flush_all, "cuptiActivityFlushAll");
    RESOLVE(finalize, "cuptiFinalize");
    RESOLVE(timestamp, "cuptiGetTimestamp");
    RESOLVE(result_string, "cuptiGetResultString");
    if (!cu.subscribe || !cu.enable_callback || !cu.enable_domain || !cu.register_cb || !cu.enable || !cu.disable ||
        !cu.next_record || !cu.flush_all || !cu.finalize || !cu.timestamp) {
        gc_log("kernel time not measured: the loaded libcupti lacks cuptiFinalize or the activity API");
        memset(&cu, 0, sizeof(cu));
        return -1;
    }
    cu.lib = lib;
    return 0;
}

/* ---- CUPTI's callbacks: no lock, nothing slow ---- */

static void CUPTIAPI on_api(void *ud, CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const void *data)
{
    (void)ud;
    const CUpti_CallbackData *cb = data;
    int driver = dom == CUPTI_CB_DOMAIN_DRIVER_API;
    if ((!driver && dom != CUPTI_CB_DOMAIN_RUNTIME_API) || !cb) return;
    if (driver && cb->callbackSite == CUPTI_API_EXIT && atomic_load_explicit(&g_detach, memory_order_acquire) == D_ASKED) {
        int asked = D_ASKED;
        if (atomic_compare_exchange_strong(&g_detach, &asked, D_FINALIZING)) {
            cu.finalize(); /* CUPTI's dynamic detach: at an API exit callsite */
            atomic_store_explicit(&g_detach, D_DONE, memory_order_release);
        }
        return;
    }
    /* A graph launch's enter, the driver's or the runtime's (its GRAPH_TRACE record may carry the runtime call's
     * correlation id: a statically linked cudart left every span unmatched with only the driver's
     * noted). Every such call takes the exec first. */
    int launch = driver ? cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch || cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz
                        : cbid == CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000 ||
                          cbid == CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000;
    if (launch && cb->callbackSite == CUPTI_API_ENTER && cb->functionParams)
        gc_graphs_timed_launch(*(CUgraphExec const *)cb->functionParams, cb->correlationId);
}

static void CUPTIAPI on_request(uint8_t **buffer, size_t *size, size_t *max_records)
{
    *buffer = NULL, *size = 0, *max_records = 0;
    void *p = NULL;
    if (atomic_fetch_add(&g_outstanding, 1) >= T_BUFFERS || posix_memalign(&p, 8, T_BUFFER) != 0) {
        atomic_fetch_sub(&g_outstanding, 1);
        return; /* CUPTI drops what it cannot store: fewer samples, nothing else */
    }
    *buffer = p;
    *size = T_BUFFER;
}

static int next(uint8_t *buffer, size_t valid, CUpti_Activity **r)
{
    return cu.next_record(buffer, valid, r) == CUPTI_SUCCESS ? 0 : -1;
}

/* Each record moved onto the census clock; a graph launch's span to its exec's mean; then the sink. */
static void CUPTIAPI on_complete(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid)
{
    (void)ctx, (void)stream, (void)size;
    if (atomic_load_explicit(&g_detach, memory_order_acquire) == D_FINALIZING)
        valid = 0;  /* from cuptiFinalize, on whatever thread: take no lock, drop what it holds */
    if (valid) {
        const int64_t off = atomic_load_explicit(&g_wall_minus_cupti, memory_order_relaxed);
        CUpti_Activity *r = NULL;
        while (next(buffer, valid, &r) == 0) {
            if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
                GC_KERNEL_T *k = (GC_KERNEL_T *)r;
                if (k->start) k->start = (uint64_t)((int64_t)k->start + off);
                if (k->end) k->end = (uint64_t)((int64_t)k->end + off);
            } else if (r->kind == CUPTI_ACTIVITY_KIND_GRAPH_TRACE) {
                CUpti_ActivityGraphTrace2 *g = (CUpti_ActivityGraphTrace2 *)r;
                if (g->start && g->end > g->start) gc_graphs_timed_span(g->correlationId, g->end - g->start);
                if (g->start) g->start = (uint64_t)((int64_t)g->start + off);
                if (g->end) g->end = (uint64_t)((int64_t)g->end + off);
            }
        }
        tm.sink(buffer, valid, next);
    }
    free(buffer);
    atomic_fetch_sub(&g_outstanding, 1);
}

/* ---- the flusher's side, under tm.mu ---- */

static void kinds_off(void)
{
    cu.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cu.disable(CUPTI_ACTIVITY_KIND_GRAPH_TRACE);
}

/* Kinds off, every record to the sink, and the next driver call's exit finalizes. */
static void begin_detach(void)
{
    kinds_off();
    cu.flush_all(0);
    cu.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (g_no_detach) { /* never cuptiFinalize (it crashed graph programs): CUPTI stays set up, its kinds off */
        tm.state = tm.more ? T_IDLE : T_OFF;
        return;
    }
    atomic_store_explicit(&g_detach, D_ASKED, memory_order_release);
    CUptiResult r = cu.enable_domain(1, tm.sub, CUPTI_CB_DOMAIN_DRIVER_API);
    if (r != CUPTI_SUCCESS) { /* no callsite to detach from: CUPTI stays, kinds off, no window again */
        atomic_store(&g_detach, D_NONE);
        gc_log("kernel time: CUPTI cannot be detached (%s); no more windows, CUPTI stays set up", err(r));
        tm.state = T_OFF;
        return;
    }
    tm.since = gc_mono_ns();
    tm.state = T_DETACHING;
}

static int attach(void)
{
    uint64_t t0 = gc_mono_ns();
    if (!cu.lib && load() != 0) {
        tm.state = T_OFF;
        return -1;
    }
    if (gc_graphs_timed_start() != 0) {
        gc_log("kernel time not measured: no memory for the graph table");
        tm.state = T_OFF;
        return -1;
    }
    CUptiResult r;
    if (g_no_detach && tm.sub) { /* set up at an earlier window (never detached): the kinds again */
        if (!g_no_graph) cu.enable(CUPTI_ACTIVITY_KIND_GRAPH_TRACE);
        cu.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
        atomic_fetch_add(&g_st.windows, 1);
        tm.state = T_ON;
        return 0;
    }
    r = cu.subscribe(&tm.sub, on_api, NULL);
    if (r != CUPTI_SUCCESS) { /* a profiler holds CUPTI now: this window is skipped, the next one tries */
        static int said;
        if (!said && (said = 1))
            gc_log("kernel time: a window skipped, CUPTI is held by another tool (%s); counts are exact", err(r));
        atomic_fetch_add(&g_st.failed, 1);
        return -1;
    }
    atomic_store(&g_detach, D_NONE);
    uint64_t w0 = gc_wall_ns(), ts = 0;
    CUptiResult tr = cu.timestamp(&ts);
    uint64_t w1 = gc_wall_ns();
    atomic_store(&g_wall_minus_cupti, (int64_t)(w0 + (w1 - w0) / 2) - (int64_t)ts);
    if ((r = cu.register_cb(on_request, on_complete)) != CUPTI_SUCCESS || tr != CUPTI_SUCCESS || !ts ||
        (!g_no_graph && (r = cu.enable(CUPTI_ACTIVITY_KIND_GRAPH_TRACE)) != CUPTI_SUCCESS) ||
        (r = cu.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)) != CUPTI_SUCCESS) {
        gc_log("kernel time not measured: CUPTI refused a window (%s); counts are exact", err(r));
        atomic_fetch_add(&g_st.failed, 1);
        tm.more = 0; /* no window again: the detach under way gives CUPTI back */
        begin_detach();
        return -1;
    }
    /* a graph launch's enter notes its exec, for its GRAPH_TRACE record's span */
    cu.enable_callback(1, tm.sub, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch);
    cu.enable_callback(1, tm.sub, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz);
    cu.enable_callback(1, tm.sub, CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000);
    cu.enable_callback(1, tm.sub, CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000);
    atomic_fetch_add(&g_st.windows, 1);
    atomic_fetch_add(&g_st.attach_ns, gc_mono_ns() - t0);
    tm.state = T_ON;
    return 0;
}

/* A detach under way that the finalizing callback has ended. */
static void detach_done(void)
{
    if (tm.state != T_DETACHING || atomic_load_explicit(&g_detach, memory_order_acquire) != D_DONE) return;
    atomic_fetch_add(&g_st.detach_ns, gc_mono_ns() - tm.since);
    tm.sub = NULL;
    atomic_store(&g_detach, D_NONE);
    tm.state = tm.more ? T_IDLE : T_OFF;
}

int gc_timing_start(const char *cupti_path, gc_timing_sink sink)
{
    const char *probe = getenv("OTEL_GPU_CENSUS_WINDOWS_PROBE");
    g_no_graph = probe && strstr(probe, "nograph");
    g_no_detach = !(probe && strstr(probe, "detach") && !strstr(probe, "nodetach"));
    pthread_mutex_lock(&tm.mu);
    tm.path = cupti_path;
    tm.sink = sink;
    tm.more = sink != NULL;
    tm.state = sink ? T_IDLE : T_OFF;
    pthread_mutex_unlock(&tm.mu);
    return sink ? 0 : -1;
}

int gc_timing_set(int on)
{
    int rc = 0;
    pthread_mutex_lock(&tm.mu);
    detach_done();
    if (on) {
        if (tm.state == T_IDLE) rc = attach();
        else rc = tm.state == T_ON ? 0 : -1; /* a detach not done yet: this window is skipped */
    } else if (tm.state == T_ON) {
        begin_detach();
    }
    pthread_mutex_unlock(&tm.mu);
    return rc;
}

void gc_timing_poll(void)
{
    if (pthread_mutex_trylock(&tm.mu) != 0) return;
    detach_done();
    pthread_mutex_unlock(&tm.mu);
}

void gc_timing_flush(void)
{
    pthread_mutex_lock(&tm.mu);
    if (tm.state == T_ON) cu.flush_all(0);
    pthread_mutex_unlock(&tm.mu);
}

/* The census ends. At exit CUPTI may be going down with the process: kinds off and the records, no detach.
 * Ended by the server (gc_finish), the process goes on: the detach gives CUPTI back too. */
void gc_timing_stop(int at_exit)
{
    pthread_mutex_lock(&tm.mu);
    tm.more = 0; /* no window again; a detach under way ends in T_OFF */
    if (tm.state == T_ON) {
        if (at_exit) {
            kinds_off();
            cu.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
            tm.state = T_OFF;
        } else {
            begin_detach();
        }
    } else if (tm.state == T_IDLE) {
        tm.state = T_OFF;
    }
    pthread_mutex_unlock(&tm.mu);
}

void gc_timing_forget(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    tm.mu = fresh; /* the parent's flusher may have held it at fork time */
    tm.state = T_OFF;
    tm.more = 0;
}

void gc_timing_stats(struct gc_timing_stats *out)
{
    out->windows = atomic_load(&g_st.windows);
    out->failed = atomic_load(&g_st.failed);
    out->attach_ns = atomic_load(&g_st.attach_ns);
    out->detach_ns = atomic_load(&g_st.detach_ns);
}

