/*
 * injector.c - loaded by the CUDA driver through CUDA_INJECTION64_PATH; asks CUPTI for kernel,
 * copy and memset records and hands each filled buffer to the tally.
 *
 * Rules this file keeps, because it runs inside someone else's server:
 *   - the server's threads only ever pay CUPTI's own cost: no lock, I/O or allocation of ours
 *     runs on a launch path (buffer requests allocate, but on CUPTI's schedule, bounded);
 *   - every failure switches the census off with one log line and leaves the server running;
 *   - memory is bounded: at most max_buffers x buffer_size of activity buffers plus the segment;
 *   - a process that never completes a record (GPU discovery, compile workers) creates no file;
 *   - a forked child never writes its parent's segment; exit flushes and marks totals complete.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cuda.h>
#include <cupti.h>

#include "gpu_census.h"
#include "internal.h"

/* OFF: never started or a forked child. FAILED: switched itself off after starting (the flusher then
 * disables the activity kinds, so the server stops paying CUPTI). EXITING: the final flush runs. */
enum { OFF = 0, ACTIVE = 1, EXITING = 2, FAILED = 3 };

/* CUPTI entry points, resolved at run time so that a missing libcupti means "census off"
 * rather than a process that cannot start. v2 = CUPTI >= 13.2 multi-subscriber API. */
static struct {
    int v2;
    CUpti_SubscriberHandle sub;
    CUptiResult (*get_version)(uint32_t *);
    CUptiResult (*result_string)(CUptiResult, const char **);
    CUptiResult (*get_timestamp)(uint64_t *);
    CUptiResult (*get_timestamp_v2)(CUpti_SubscriberHandle, uint64_t *);
    CUptiResult (*subscribe)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *);
    CUptiResult (*unsubscribe)(CUpti_SubscriberHandle);
    CUptiResult (*subscribe_v2)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *, CUpti_SubscriberParams *);
    CUptiResult (*register_cb)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc);
    CUptiResult (*register_cb_v2)(CUpti_SubscriberHandle, CUpti_BuffersCallbackRequestFunc_v2, CUpti_BuffersCallbackCompleteFunc_v2);
    CUptiResult (*enable)(CUpti_ActivityKind);
    CUptiResult (*enable_v2)(CUpti_SubscriberHandle, CUpti_ActivityKind, CUpti_ActivityConfig *);
    CUptiResult (*disable)(CUpti_ActivityKind);
    CUptiResult (*disable_v2)(CUpti_SubscriberHandle, CUpti_ActivityKind, CUpti_ActivityConfig *);
    CUptiResult (*next_record)(uint8_t *, size_t, CUpti_Activity **);
    CUptiResult (*next_record_v2)(CUpti_SubscriberHandle, uint8_t *, size_t, CUpti_Activity **);
    CUptiResult (*dropped)(CUcontext, uint32_t, size_t *);
    CUptiResult (*dropped_v2)(CUpti_SubscriberHandle, CUcontext, uint32_t, size_t *);
    CUptiResult (*push)(CUpti_ExternalCorrelationKind, uint64_t);
    CUptiResult (*push_v2)(CUpti_SubscriberHandle, CUpti_ExternalCorrelationKind, uint64_t);
    CUptiResult (*pop)(CUpti_ExternalCorrelationKind, uint64_t *);
    CUptiResult (*pop_v2)(CUpti_SubscriberHandle, CUpti_ExternalCorrelationKind, uint64_t *);
    CUptiResult (*flush_all)(uint32_t);
    CUptiResult (*flush_period)(uint32_t);
} cu;

static atomic_int g_state;            /* OFF until InitializeInjection succeeds */
static atomic_int g_flusher_busy;     /* the flusher is inside CUPTI: exit waits for it */
static CUpti_ActivityKind g_kinds[8]; /* what we enabled, to disable it when we fail */
static int g_nkinds;
static pid_t g_pid;                   /* the process the census belongs to (fork guard) */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* tally + segment writes */
static gc_segment *g_seg;
static gc_tally *g_tally;
static int g_seg_failed;
static char g_path[4096];
static uint64_t g_clock_ref_gpu;
static uint64_t g_start_wall;         /* CLOCK_REALTIME at InitializeInjection */
static uint32_t g_flush_ms = 1000;
static size_t g_buffer_size = 2u << 20;
static int g_max_buffers = 32;
static atomic_int g_outstanding;
static atomic_ullong g_refused;

/* Kernel sampling (OTEL_GPU_CENSUS_KERNELS = all | off | ON_MS/PERIOD_MS). Kernel records are what
 * CUPTI charges per launch; copies are few and stay exact. The flusher thread switches the kernel
 * kind on for ON_MS of every PERIOD_MS, on a schedule fixed in CUPTI time so readers can tell which
 * windows were traced. Touched only by the start code and then the flusher (and exit, after it). */
static struct {
    uint32_t mode, on_ms, period_ms;
    int tracing;                /* the kernel kind is enabled now */
    uint64_t origin_gpu;        /* CUPTI timestamp the schedule counts from */
    int64_t gpu_minus_mono;     /* CUPTI clock - CLOCK_MONOTONIC, read together at start */
    uint64_t traced_ns;         /* closed on-phases, monotonic ns */
    uint64_t on_since;          /* monotonic ns the current on-phase began */
} g_ks;

static const char *cupti_error(CUptiResult r)
{
    const char *s = NULL;
    if (cu.result_string && cu.result_string(r, &s) == CUPTI_SUCCESS && s) return s;
    return "unknown CUPTI error";
}

static long env_long(const char *name, long dflt, long lo, long hi)
{
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    long x = strtol(v, &end, 10);
    if (*end || x < lo || x > hi) {
        gc_log("ignoring %s=%s (expected an integer in [%ld, %ld]); using %ld", name, v, lo, hi, dflt);
        return dflt;
    }
    return x;
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* OTEL_GPU_CENSUS_KERNELS: all (default), off, or ON_MS/PERIOD_MS with both multiples of the
 * 20 ms window and 0 < ON_MS < PERIOD_MS <= 1 h. Anything else: one line, and all kernels. */
static void parse_kernels(void)
{
    const char *v = getenv("OTEL_GPU_CENSUS_KERNELS");
    g_ks.mode = GC_KERNELS_ALL;
    if (!v || !*v || strcmp(v, "all") == 0) return;
    if (strcmp(v, "off") == 0) {
        g_ks.mode = GC_KERNELS_OFF;
        return;
    }
    const uint32_t w = (uint32_t)(GC_WINDOW_NS / 1000000ull);
    char *end;
    unsigned long on = strtoul(v, &end, 10), period = 0;
    if (end != v && *end == '/') {
        char *p = end + 1;
        period = strtoul(p, &end, 10);
        if (end == p) period = 0;
    }
    if (*end || on == 0 || period <= on || period > 3600000ul || on % w || period % w) {
        gc_log("ignoring OTEL_GPU_CENSUS_KERNELS=%s (expected all, off or ON_MS/PERIOD_MS, multiples of "
               "%u ms, ON_MS < PERIOD_MS); tracing all kernels", v, w);
        return;
    }
    g_ks.mode = GC_KERNELS_SAMPLED;
    g_ks.on_ms = (uint32_t)on;
    g_ks.period_ms = (uint32_t)period;
}

/* Called with g_mu held: the schedule and how long kernels were traced, as of `mono`. */
static void publish_kernels(gc_segment *seg, uint64_t mono)
{
    seg->kernel_mode = g_ks.mode;
    seg->kernel_on_ms = g_ks.on_ms;
    seg->kernel_period_ms = g_ks.period_ms;
    seg->kernel_origin_gpu_ns = g_ks.origin_gpu;
    seg->kernel_tracing = g_ks.mode == GC_KERNELS_ALL || g_ks.tracing;
    if (g_ks.mode == GC_KERNELS_SAMPLED)
        seg->kernel_traced_ns = g_ks.traced_ns + (g_ks.tracing && mono > g_ks.on_since ? mono - g_ks.on_since : 0);
}

/* ---- device UUIDs, from the driver already loaded in this process ---- */

static void fill_uuids(gc_segment *seg)
{
    static void *libcuda;
    static CUresult (*dev_get)(CUdevice *, int);
    static CUresult (*get_uuid)(CUuuid *, CUdevice);
    if (!libcuda) {
        libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (!libcuda) return;
        dev_get = (CUresult (*)(CUdevice *, int))dlsym(libcuda, "cuDeviceGet");
        get_uuid = (CUresult (*)(CUuuid *, CUdevice))dlsym(libcuda, "cuDeviceGetUuid_v2");
    }
    if (!dev_get || !get_uuid) return;
    for (uint32_t i = 0; i < GC_MAX_DEVICES; i++) {
        gc_device *d = &seg->devices[i];
        static const uint8_t zero[16];
        if (!d->in_use || memcmp(d->uuid, zero, 16) != 0) continue;
        CUdevice dev;
        CUuuid u;
        if (dev_get(&dev, (int)i) == CUDA_SUCCESS && get_uuid(&u, dev) == CUDA_SUCCESS)
            memcpy(d->uuid, u.bytes, 16);
    }
}

/* ---- buffers ---- */

static void request_buffer(uint8_t **buffer, size_t *size, size_t *max_records)
{
    *buffer = NULL;
    *size = 0;
    *max_records = 0;
    /* Over the bound, CUPTI gets no buffer and drops records; it counts them and so do we. */
    if (atomic_fetch_add(&g_outstanding, 1) >= g_max_buffers) {
        atomic_fetch_sub(&g_outstanding, 1);
        atomic_fetch_add(&g_refused, 1);
        return;
    }
    void *p = NULL;
    if (posix_memalign(&p, 8, g_buffer_size) != 0) {
        atomic_fetch_sub(&g_outstanding, 1);
        atomic_fetch_add(&g_refused, 1);
        return;
    }
    *buffer = p;
    *size = g_buffer_size;
}

static void CUPTIAPI on_request(uint8_t **buffer, size_t *size, size_t *max_records)
{
    request_buffer(buffer, size, max_records);
}

static void CUPTIAPI on_request_v2(uint8_t **buffer, size_t *size, size_t *max_records,
                                   CUpti_BufferCallbackRequestInfo *info)
{
    (void)info;
    request_buffer(buffer, size, max_records);
}

/* Called with g_mu held. The file is made on the first record, so short-lived CUDA processes
 * that never complete one leave nothing behind. */
static gc_segment *segment(void)
{
    if (g_seg || g_seg_failed) return g_seg;
    gc_segment *seg = gc_segment_open(g_path, sizeof(g_path));
    gc_tally *t = seg ? gc_tally_create(seg) : NULL;
    if (!seg || !t) {
        if (seg) munmap(seg, sizeof(*seg));
        if (seg && !t) gc_log("census off: out of memory for the tally");
        g_seg_failed = 1;
        int active = ACTIVE;
        atomic_compare_exchange_strong(&g_state, &active, FAILED);
        return NULL;
    }
    gc_segment_init(seg, NULL, g_start_wall, g_clock_ref_gpu);
    seg->cupti_version = 0;
    if (cu.get_version) cu.get_version(&seg->cupti_version);
    publish_kernels(seg, mono_ns());
    g_tally = t;
    g_seg = seg;
    return seg;
}

/* Records CUPTI could not store (no buffer, or full) and buffer requests we refused. */
static void count_losses(gc_segment *seg, CUcontext ctx, uint32_t stream)
{
    size_t dropped = 0;
    CUptiResult dr = cu.v2 ? cu.dropped_v2(cu.sub, ctx, stream, &dropped) : cu.dropped(ctx, stream, &dropped);
    if (dr == CUPTI_SUCCESS && dropped) seg->dropped += dropped;
    seg->buffers_refused = atomic_load(&g_refused);
    if (seg->dropped || seg->buffers_refused) seg->flags |= GC_FLAG_DROPPED;
}

static void tally_buffer(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t valid)
{
    if (getpid() != g_pid) return; /* a forked child: the segment is the parent's */
    pthread_mutex_lock(&g_mu);
    gc_segment *seg = valid > 0 ? segment() : g_seg;
    if (seg) {
        gc_segment_begin_update(seg);
        CUpti_Activity *r = NULL;
        if (valid > 0) {
            for (;;) {
                CUptiResult res = cu.v2 ? cu.next_record_v2(cu.sub, buffer, valid, &r)
                                        : cu.next_record(buffer, valid, &r);
                if (res != CUPTI_SUCCESS) break;
                gc_tally_record(g_tally, r);
            }
        }
        seg->buffers++;
        count_losses(seg, ctx, stream);
        fill_uuids(seg);
        gc_tally_publish(g_tally, 0);
        gc_segment_end_update(seg);
    }
    pthread_mutex_unlock(&g_mu);
}

static void CUPTIAPI on_complete(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid)
{
    (void)size;
    tally_buffer(ctx, stream, buffer, valid);
    free(buffer); /* ours: CUPTI hands each buffer back exactly once */
    atomic_fetch_sub(&g_outstanding, 1);
}

static void CUPTIAPI on_complete_v2(uint8_t *buffer, size_t size, size_t valid,
                                    CUpti_BufferCallbackCompleteInfo *info)
{
    (void)info;
    on_complete(NULL, 0, buffer, size, valid);
}

/* ---- the flusher: totals at most one period stale, and a known "complete up to" time ---- */

/* Every period: note the time, have CUPTI hand back every buffer whose records are complete, then
 * publish that time. Readers (the proxy) then know that GPU work which finished before it is in the
 * totals, also on an idle server where no buffer fills. Runs on its own thread with all signals
 * blocked; it never touches the server's threads. */
static void disable_kinds(void)
{
    for (int i = 0; i < g_nkinds; i++) {
        if (cu.v2 && cu.disable_v2) cu.disable_v2(cu.sub, g_kinds[i], NULL);
        else if (!cu.v2 && cu.disable) cu.disable(g_kinds[i]);
    }
}

static int set_kernels(int on)
{
    CUptiResult r;
    if (on) r = cu.v2 ? cu.enable_v2(cu.sub, CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, NULL)
                      : cu.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    else r = cu.v2 ? cu.disable_v2(cu.sub, CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, NULL)
                   : cu.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    return r == CUPTI_SUCCESS ? 0 : -1;
}

/* Sampled kernels: switch the kind to what the schedule says for `mono`; returns the monotonic time
 * of the next phase change. Computed from the schedule, not from the last wake-up, so a late
 * thread neither drifts nor traces longer than ON_MS; a phase it slept through is skipped. */
static uint64_t kernel_phase(uint64_t mono)
{
    const uint64_t P = (uint64_t)g_ks.period_ms * 1000000ull, ON = (uint64_t)g_ks.on_ms * 1000000ull;
    uint64_t origin_mono = (uint64_t)((int64_t)g_ks.origin_gpu - g_ks.gpu_minus_mono);
    uint64_t t = mono > origin_mono ? mono - origin_mono : 0, k = t / P, r = t % P;
    int want = r < ON;
    if (want != g_ks.tracing && set_kernels(want) == 0) {
        pthread_mutex_lock(&g_mu);
        if (want) g_ks.on_since = mono;
        else g_ks.traced_ns += mono - g_ks.on_since;
        g_ks.tracing = want;
        pthread_mutex_unlock(&g_mu);
    }
    return origin_mono + k * P + (want ? ON : P);
}

static void sleep_until(uint64_t mono)
{
    struct timespec ts = {(time_t)(mono / 1000000000ull), (long)(mono % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {}
}

static void *flusher(void *arg)
{
    (void)arg;
    const uint64_t period = (uint64_t)g_flush_ms * 1000000ull;
    uint64_t next_flush = mono_ns() + period;
    uint64_t next_phase = UINT64_MAX;
    if (g_ks.mode == GC_KERNELS_SAMPLED) next_phase = kernel_phase(mono_ns());
    for (;;) {
        sleep_until(next_phase < next_flush ? next_phase : next_flush);
        if (getpid() != g_pid) break;
        int st = atomic_load(&g_state);
        if (st == FAILED) { /* outside any CUPTI callback: safe to stop the tracing */
            disable_kinds();
            break;
        }
        if (st != ACTIVE) break;
        atomic_store(&g_flusher_busy, 1);
        uint64_t now = mono_ns();
        if (atomic_load(&g_state) == ACTIVE && now >= next_phase) /* exit may have begun meanwhile */
            next_phase = kernel_phase(now);
        if (atomic_load(&g_state) == ACTIVE && now >= next_flush) {
            next_flush = now - next_flush < period ? next_flush + period : now + period;
            uint64_t t = gc_wall_ns();
            uint64_t m = mono_ns();
            if (cu.flush_all(0) == CUPTI_SUCCESS) {
                pthread_mutex_lock(&g_mu);
                if (g_seg && atomic_load(&g_state) == ACTIVE) {
                    gc_segment_begin_update(g_seg);
                    g_seg->complete_wall_ns = t;
                    publish_kernels(g_seg, m);
                    count_losses(g_seg, NULL, 0);
                    gc_segment_end_update(g_seg);
                }
                pthread_mutex_unlock(&g_mu);
            }
        }
        atomic_store(&g_flusher_busy, 0);
    }
    return NULL;
}

static int start_flusher(void)
{
    pthread_attr_t attr;
    pthread_t th;
    sigset_t all, old;
    if (pthread_attr_init(&attr) != 0) return -1;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the new thread inherits "all blocked" */
    /* A small stack first; glibc puts the process's static TLS on every thread stack, and with
     * llama-server's libraries 64 KiB was too small (EINVAL): then the default size (virtual). */
    int rc = pthread_attr_setstacksize(&attr, 256 * 1024) == 0 ? pthread_create(&th, &attr, flusher, NULL) : EINVAL;
    if (rc == EINVAL) {
        pthread_attr_destroy(&attr);
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        rc = pthread_create(&th, &attr, flusher, NULL);
    }
    if (rc != 0) gc_log("cannot start the flusher thread: %s", strerror(rc));
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    return rc == 0 ? 0 : -1;
}

/* ---- process life: exit and fork ---- */

static void at_exit(void)
{
    int active = ACTIVE;
    if (getpid() != g_pid || !atomic_compare_exchange_strong(&g_state, &active, EXITING)) return;
    /* The flusher starts no new flush now; let one in progress end (bounded: never hang an exit). */
    for (int i = 0; i < 200 && atomic_load(&g_flusher_busy); i++) {
        struct timespec ms = {0, 1000000L};
        nanosleep(&ms, NULL);
    }
    /* Forced: also returns buffers holding records of work still in flight. */
    uint64_t t = gc_wall_ns();
    cu.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    pthread_mutex_lock(&g_mu);
    if (g_seg) {
        gc_segment_begin_update(g_seg);
        gc_tally_publish(g_tally, 1);
        g_seg->complete_wall_ns = t;
        publish_kernels(g_seg, mono_ns());
        count_losses(g_seg, NULL, 0);
        g_seg->state = GC_STATE_EXITED;
        gc_segment_end_update(g_seg);
        msync(g_seg, sizeof(*g_seg), MS_ASYNC);
    }
    atomic_store(&g_state, OFF);
    pthread_mutex_unlock(&g_mu);
}

static void at_fork_child(void)
{
    /* CUDA is unusable in a child forked after init and CUPTI's threads did not come along.
     * Drop our view of the parent's segment; an exec'd CUDA program gets its own census. */
    atomic_store(&g_state, OFF);
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    g_mu = fresh; /* the parent's CUPTI thread may have held it at fork time */
    if (g_seg) munmap(g_seg, sizeof(*g_seg));
    g_seg = NULL;
    g_tally = NULL; /* the parent's heap copy: leaked on purpose, freeing it is not our business */
    g_path[0] = 0;
}

/* ---- start ---- */

#define RESOLVE(field, name) (*(void **)&cu.field = dlsym(lib, name))

static void *load_cupti(void)
{
    const char *path = getenv("OTEL_GPU_CENSUS_CUPTI");
    void *lib = NULL;
    /* A libcupti already loaded (torch links one) must be the one we use: one per process. */
    lib = dlopen("libcupti.so.13", RTLD_NOW | RTLD_NOLOAD);
    if (!lib && path && *path) {
        /* a path the user named and that does not load is an error, not a hint */
        lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            const char *why = dlerror();
            gc_log("census off: cannot load OTEL_GPU_CENSUS_CUPTI=%s: %s", path, why ? why : "?");
            return NULL;
        }
    }
    if (!lib) lib = dlopen("libcupti.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        gc_log("census off: libcupti.so.13 not found; install nvidia-cuda-cupti or set OTEL_GPU_CENSUS_CUPTI");
        return NULL;
    }
    RESOLVE(get_version, "cuptiGetVersion");
    RESOLVE(result_string, "cuptiGetResultString");
    RESOLVE(get_timestamp, "cuptiGetTimestamp");
    RESOLVE(get_timestamp_v2, "cuptiGetTimestamp_v2");
    RESOLVE(subscribe, "cuptiSubscribe");
    RESOLVE(unsubscribe, "cuptiUnsubscribe");
    RESOLVE(subscribe_v2, "cuptiSubscribe_v2");
    RESOLVE(register_cb, "cuptiActivityRegisterCallbacks");
    RESOLVE(register_cb_v2, "cuptiActivityRegisterCallbacks_v2");
    RESOLVE(enable, "cuptiActivityEnable");
    RESOLVE(enable_v2, "cuptiActivityEnable_v2");
    RESOLVE(disable, "cuptiActivityDisable");
    RESOLVE(disable_v2, "cuptiActivityDisable_v2");
    RESOLVE(next_record, "cuptiActivityGetNextRecord");
    RESOLVE(next_record_v2, "cuptiActivityGetNextRecord_v2");
    RESOLVE(dropped, "cuptiActivityGetNumDroppedRecords");
    RESOLVE(dropped_v2, "cuptiActivityGetNumDroppedRecords_v2");
    RESOLVE(push, "cuptiActivityPushExternalCorrelationId");
    RESOLVE(push_v2, "cuptiActivityPushExternalCorrelationId_v2");
    RESOLVE(pop, "cuptiActivityPopExternalCorrelationId");
    RESOLVE(pop_v2, "cuptiActivityPopExternalCorrelationId_v2");
    RESOLVE(flush_all, "cuptiActivityFlushAll");
    RESOLVE(flush_period, "cuptiActivityFlushPeriod");
    if (!cu.register_cb || !cu.enable || !cu.disable || !cu.next_record || !cu.dropped || !cu.push || !cu.pop ||
        !cu.flush_all || !cu.flush_period) {
        gc_log("census off: the loaded libcupti lacks the activity API");
        return NULL;
    }
    return lib;
}

/* Multi-subscriber mode (CUPTI >= 13.2) lets torch.profiler or Nsight work beside us. */
static int want_v2(void)
{
    const char *m = getenv("OTEL_GPU_CENSUS_CUPTI_API");
    if (m && strcmp(m, "v1") == 0) return 0;
    return cu.subscribe_v2 && cu.register_cb_v2 && cu.enable_v2 && cu.next_record_v2 &&
           cu.dropped_v2 && cu.push_v2 && cu.pop_v2;
}

static int start(void)
{
    CUptiResult r;
    if (want_v2()) {
        char other[CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN + 1] = {0};
        CUpti_SubscriberParams p;
        memset(&p, 0, sizeof(p));
        p.structSize = CUpti_SubscriberParams_STRUCT_SIZE;
        p.subscriberName = "otel-gpu-census";
        p.oldSubscriberName = other;
        p.oldSubscriberSize = sizeof(other) - 1;
        p.allowMultipleSubscribers = 1;
        r = cu.subscribe_v2(&cu.sub, NULL, NULL, &p);
        if (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) {
            gc_log("census off: CUPTI is in use by %s, which does not share it; the server runs "
                   "without census", other[0] ? other : "another tool");
            return -1;
        }
        if (r == CUPTI_SUCCESS) cu.v2 = 1;
        /* anything else: fall back to the single-subscriber API below */
    }
    if (!cu.v2 && cu.subscribe && cu.unsubscribe) {
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
    r = cu.v2 ? cu.register_cb_v2(cu.sub, on_request_v2, on_complete_v2)
              : cu.register_cb(on_request, on_complete);
    if (r != CUPTI_SUCCESS) {
        gc_log("census off: cannot register activity buffers: %s", cupti_error(r));
        return -1;
    }
    const char *graphs = getenv("OTEL_GPU_CENSUS_GRAPHS");
    int per_launch = graphs && strcmp(graphs, "launch") == 0;
    parse_kernels();
    CUpti_ActivityKind kinds[] = {
        g_ks.mode == GC_KERNELS_OFF ? CUPTI_ACTIVITY_KIND_INVALID : CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
        CUPTI_ACTIVITY_KIND_MEMCPY,
        CUPTI_ACTIVITY_KIND_MEMCPY2, CUPTI_ACTIVITY_KIND_MEMSET,
        CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
        per_launch ? CUPTI_ACTIVITY_KIND_GRAPH_TRACE : CUPTI_ACTIVITY_KIND_INVALID,
    };
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        if (kinds[i] == CUPTI_ACTIVITY_KIND_INVALID) continue;
        r = cu.v2 ? cu.enable_v2(cu.sub, kinds[i], NULL) : cu.enable(kinds[i]);
        if (r != CUPTI_SUCCESS) {
            gc_log("census off: cannot enable activity kind %d: %s", (int)kinds[i], cupti_error(r));
            disable_kinds(); /* the ones already on */
            return -1;
        }
        g_kinds[g_nkinds++] = kinds[i];
    }
    g_flush_ms = (uint32_t)env_long("OTEL_GPU_CENSUS_FLUSH_MS", 1000, 10, 60000);
    uint64_t ts = 0, m0 = mono_ns();
    /* Under the v2 API (measured with libcupti 13.5) the legacy cuptiGetTimestamp fails: ask as
     * our subscriber. */
    CUptiResult tr = CUPTI_ERROR_NOT_INITIALIZED;
    if (cu.v2 && cu.get_timestamp_v2 && (tr = cu.get_timestamp_v2(cu.sub, &ts)) != CUPTI_SUCCESS) ts = 0;
    if (!ts && cu.get_timestamp && (tr = cu.get_timestamp(&ts)) != CUPTI_SUCCESS) ts = 0;
    g_clock_ref_gpu = ts;
    uint64_t m1 = mono_ns();
    /* The schedule starts now, with kernels on (enabled above). Without a CUPTI clock, sampling
     * cannot be placed on the records' time line: trace every kernel instead. */
    if (g_ks.mode == GC_KERNELS_SAMPLED && !ts) {
        gc_log("OTEL_GPU_CENSUS_KERNELS: no CUPTI timestamp (%s); tracing all kernels", cupti_error(tr));
        g_ks.mode = GC_KERNELS_ALL;
    }
    g_ks.gpu_minus_mono = (int64_t)(ts - (m0 + (m1 - m0) / 2));
    g_ks.origin_gpu = ts;
    g_ks.tracing = g_ks.mode != GC_KERNELS_OFF;
    g_ks.on_since = m1;
    return 0;
}

int InitializeInjection(void)
{
    static atomic_int once;
    if (atomic_exchange(&once, 1)) return 1;
    const char *off = getenv("OTEL_GPU_CENSUS_DISABLED");
    if (off && *off && strcmp(off, "0") != 0) return 1;
    g_buffer_size = (size_t)env_long("OTEL_GPU_CENSUS_BUFFER_KB", 2048, 64, 65536) * 1024;
    g_max_buffers = (int)env_long("OTEL_GPU_CENSUS_MAX_BUFFERS", 32, 2, 4096);
    g_pid = getpid();
    g_start_wall = gc_wall_ns();
    if (!load_cupti() || start() != 0) return 1; /* 1 either way: the driver must carry on */
    pthread_atfork(NULL, NULL, at_fork_child);
    atexit(at_exit);
    atomic_store(&g_state, ACTIVE);
    /* Our flusher, else CUPTI's own periodic flush (no "complete up to" time then). */
    if (start_flusher() != 0) {
        cu.flush_period(g_flush_ms);
        if (g_ks.mode == GC_KERNELS_SAMPLED) { /* nobody to switch kernels off: trace them all */
            gc_log("no flusher thread: tracing all kernels instead of OTEL_GPU_CENSUS_KERNELS=%u/%u",
                   g_ks.on_ms, g_ks.period_ms);
            g_ks.mode = GC_KERNELS_ALL;
        }
    }
    return 1;
}

/* ---- C API for callers inside the process ---- */

uint32_t gc_layout_version(void) { return GC_LAYOUT_VERSION; }

int gc_active(void) { return atomic_load(&g_state) == ACTIVE && getpid() == g_pid; }
/* (EXITING and FAILED count as not active: no new steps, no forced flushes from callers.) */

int gc_step_begin(uint64_t id)
{
    if (!gc_active() || id == 0) return -1;
    CUptiResult r = cu.v2 ? cu.push_v2(cu.sub, GC_EXTERNAL_KIND, id) : cu.push(GC_EXTERNAL_KIND, id);
    return r == CUPTI_SUCCESS ? 0 : -1;
}

int gc_step_end(uint64_t *id)
{
    uint64_t last = 0;
    if (!gc_active()) return -1;
    CUptiResult r = cu.v2 ? cu.pop_v2(cu.sub, GC_EXTERNAL_KIND, &last) : cu.pop(GC_EXTERNAL_KIND, &last);
    if (id) *id = last;
    return r == CUPTI_SUCCESS ? 0 : -1;
}

int gc_flush(void)
{
    if (!gc_active()) return -1;
    return cu.flush_all(0) == CUPTI_SUCCESS ? 0 : -1;
}

const char *gc_segment_path(void) { return g_path; }
