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
#include <fcntl.h>
#include <stdio.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cuda.h>
#include <cupti.h>

#include "gpu_census.h"
#include "cupti_api.h"
#include "internal.h"

/* OFF: never started or a forked child. FAILED: switched itself off after starting (the flusher then
 * disables the activity kinds, so the server stops paying CUPTI). EXITING: the final flush runs.
 */
enum { OFF = 0, ACTIVE = 1, EXITING = 2, FAILED = 3 };

static atomic_int g_state;            /* OFF until InitializeInjection succeeds */
static atomic_int g_flusher_busy;     /* the flusher is inside CUPTI: exit waits for it */
static CUpti_ActivityKind g_kinds[8]; /* what we enabled, to disable it when we fail or pause */
static int g_nkinds;
static pid_t g_pid;                   /* the process the census belongs to (fork guard) */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* tally + segment writes */
static gc_segment *g_seg;
static gc_tally *g_tally;
static int g_seg_failed;
static char g_path[4096];
static atomic_int g_path_set;         /* g_path is whole: written once under g_mu, then read by any thread */
static uint64_t g_clock_ref_gpu;
static uint64_t g_start_wall;         /* CLOCK_REALTIME at InitializeInjection */
static struct gc_config g_cfg;
static atomic_int g_outstanding;
static atomic_ullong g_refused;

/* The collector in force (enum gc_collector), fixed at start, and the census clock less CLOCK_MONOTONIC, read
 * together at start (CUPTI's clock under PRECISE; CLOCK_REALTIME under DEFAULT). */
static uint32_t g_collector;
static int64_t g_gpu_minus_mono;
static atomic_uint g_contexts_late;   /* PRECISE: CONTEXT_CREATED callbacks after CUPTI was set up */

/* How graph launches are traced now (enum gc_graphs); launch needs graphs.c's callbacks (v2 API). */
static uint32_t g_graph_mode;
static int g_graphs_learned;          /* graphs.c is learning graph contents */
/* The default collector in force: everything counted at its call (calls.c, launches.c), CUPTI never loaded (no
 * buffers, no kinds, no flush). Fixed at start. */
static int g_calls;
/* ... asked for, with the library preloaded (interpose.c): start() tries it first. */
static int g_preload;
/* ... with kernel durations from CUDA event pairs around a sample of the launches (events.c); 0: none measured. */
static int g_events;

/* CUPTI's unified-memory counters (the precise collector), turned on at the process's first managed allocation (its
 * callback, before the allocation returns: no page of it has moved yet), or at the flusher's first wake where no
 * callback tells of allocations. 0 off, 1 on, -1 refused (one line says so). */
static struct {
    atomic_int state;
    int at_wake;                /* no managed callbacks: the flusher turns them on */
    int kind_on;                /* the activity kind is enabled now (a pause disables it) */
    uint64_t since_wall_ns;
    uint32_t code;
    pthread_mutex_t mu;         /* never taken with g_mu held, nor g_mu with it */
} g_um = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* GGML_CUDA_ENABLE_UNIFIED_MEMORY was set at start (llama.cpp's switch to managed memory, whatever its value). */
static int g_env_unified;

/* The control file (see control_poll); touched by the flusher only, published under g_mu. */
static struct {
    int paused;
    uint64_t paused_since, paused_ns; /* monotonic ns */
    char last[128];                   /* the content last applied */
    int finish;                       /* census=finish: the final flush, by the flusher, now */
} g_ctl;


/* Called with g_mu held: how the census counts, as of `mono`. */
static void publish_kernels(gc_segment *seg, uint64_t mono)
{
    seg->collector = g_collector;
    seg->graph_mode = g_graph_mode;
    seg->paused = g_ctl.paused;
    seg->paused_ns = g_ctl.paused_ns + (g_ctl.paused && mono > g_ctl.paused_since ? mono - g_ctl.paused_since : 0);
    seg->contexts_late = atomic_load(&g_contexts_late);
    if (g_events) {
        struct gc_events_stats st;
        gc_events_stats(&st);
        gc_timing *tm = &seg->timing;
        tm->on = 1;
        tm->every_eager = st.every_eager;
        tm->every_graph = st.every_graph;
        tm->timed = st.timed;
        tm->missed = st.missed;
        tm->failed = st.failed;
        tm->idle = st.idle;
        tm->idle_ns = st.idle_ns;
        tm->gate = st.gate;
        tm->gated = st.gated;
        tm->forced = st.forced;
        tm->lead = st.lead;
        tm->lead_ns = st.lead_ns;
    }
    if (g_preload) gc_interpose_unseen(seg);
    gc_managed_publish(seg);
    if (g_env_unified) seg->flags |= GC_FLAG_ENV_UNIFIED;
    int um = atomic_load(&g_um.state);
    if (um > 0) {
        seg->flags |= GC_FLAG_UM_COUNTERS;
        seg->um_since_wall_ns = g_um.since_wall_ns;
    } else if (um < 0) {
        seg->flags |= GC_FLAG_UM_REFUSED;
        seg->um_refused_code = g_um.code;
    }
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
    if (atomic_fetch_add(&g_outstanding, 1) >= g_cfg.max_buffers) {
        atomic_fetch_sub(&g_outstanding, 1);
        atomic_fetch_add(&g_refused, 1);
        return;
    }
    void *p = NULL;
    if (posix_memalign(&p, 8, g_cfg.buffer_size) != 0) {
        atomic_fetch_sub(&g_outstanding, 1);
        atomic_fetch_add(&g_refused, 1);
        return;
    }
    *buffer = p;
    *size = g_cfg.buffer_size;
}

static void CUPTIAPI on_request(uint8_t **buffer, size_t *size, size_t *max_records)
{
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
    seg->cupti_version = gc_cupti_version();
    publish_kernels(seg, gc_mono_ns());
    g_tally = t;
    g_seg = seg;
    atomic_store_explicit(&g_path_set, 1, memory_order_release);
    return seg;
}

/* Records CUPTI could not store (no buffer, or full) and buffer requests we refused. */
static void count_losses(gc_segment *seg, CUcontext ctx, uint32_t stream)
{
    size_t dropped = 0;
    if (g_calls) return; /* no records to drop; asking would be the activity API */
    CUptiResult dr = gc_cupti_dropped(ctx, stream, &dropped);
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
                if (gc_cupti_next_record(buffer, valid, &r) != CUPTI_SUCCESS) break;
                gc_tally_record(g_tally, r);
            }
        }
        seg->buffers++;
        count_losses(seg, ctx, stream);
        fill_uuids(seg);
        gc_launches_fold(g_tally, seg, gc_mono_ns());
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

/* Every enable and disable goes through here and only changes what is not so already: CUPTI does not
 * promise that a second disable is harmless, and the duty cycle, pauses and mode switches each switch
 * the kernel kind. The kernel kind itself goes through kernel_kind() (above). */
static uint8_t g_kind_on[CUPTI_ACTIVITY_KIND_COUNT];

/* The kernel kind. With CUPTI 13.5 on driver 580, CONCURRENT_KERNEL disabled and enabled again
 * globally under load stops eager kernel records for good after a few switches, silently; switched per
 * context it keeps them. So it is
 * enabled globally once and then switched per known context (contexts.c); globally only while no
 * context is known (then there are no kernels to lose) or where CUPTI refuses per-context switching. */
static int g_kernel_global;       /* enabled globally by us now */
static int g_kernel_global_off;   /* it was disabled globally after being enabled (a re-enable is suspect) */
static int g_contexts_followed;   /* CONTEXT_CREATED reaches us: every context is known once made */
static int g_ctx_refused;         /* CUPTI refused a per-context setting (the v2 API on driver 580) */

static CUptiResult kernel_kind(int on)
{
    /* A first global enable (never a re-enable), before any context is switched: contexts made later start
     * traced. */
    if (on && !g_kernel_global && !g_kernel_global_off &&
        gc_cupti_enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) == CUPTI_SUCCESS)
        g_kernel_global = 1;
    /* once CUPTI refused a per-context setting, the kind is switched globally for good */
    int n = g_ctx_refused ? -1 : gc_contexts_switch(on, 0, g_kernel_global);
    if (n > 0) return CUPTI_SUCCESS;
    /* No context yet, and each one made is learned (and switched at the flusher's next wake): the kind
     * stays on globally. Set up in cuInit, switching it off and on globally before the server's context
     * existed and once after lost that context's first seconds of records. */
    if (n == 0 && g_contexts_followed && !on) return CUPTI_SUCCESS;
    if (n < 0 && !g_ctx_refused) {
        g_ctx_refused = 1;
        gc_log("kernel records switched globally: CUPTI refused to switch them per context (they may stop "
               "after a few switches)");
    }
    if (on == g_kernel_global) return CUPTI_SUCCESS;
    CUptiResult r = on ? gc_cupti_enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
                       : gc_cupti_disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    if (r == CUPTI_SUCCESS) {
        g_kernel_global = on;
        if (!on) g_kernel_global_off = 1;
    }
    return r;
}

static CUptiResult kind_set(CUpti_ActivityKind k, int on)
{
    int known = (unsigned)k < (unsigned)CUPTI_ACTIVITY_KIND_COUNT;
    if (known && g_kind_on[k] == on) return CUPTI_SUCCESS;
    CUptiResult r = k == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL ? kernel_kind(on)
                  : on ? gc_cupti_enable(k) : gc_cupti_disable(k);
    if (r == CUPTI_SUCCESS && known) g_kind_on[k] = (uint8_t)on;
    return r;
}

/* ---- managed memory (the precise collector): CUPTI's unified-memory counters ---- */

static void um_enable(void)
{
    if (g_calls || atomic_load(&g_um.state)) return;
    pthread_mutex_lock(&g_um.mu);
    if (!atomic_load(&g_um.state)) {
        CUptiResult r = gc_cupti_um_configure();
        /* a paused census gets the kind when it is switched on again (um_switch) */
        if (r == CUPTI_SUCCESS && !g_ctl.paused && (r = gc_cupti_enable(CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER)) ==
            CUPTI_SUCCESS)
            g_um.kind_on = 1;
        if (r == CUPTI_SUCCESS) {
            g_um.since_wall_ns = gc_wall_ns();
            atomic_store(&g_um.state, 1);
        } else {
            g_um.code = (uint32_t)r;
            atomic_store(&g_um.state, -1);
            gc_log("CUPTI gives no unified-memory counters here (%s): page migrations of managed memory%s are not "
                   "measured; everything else stays exact", gc_cupti_error(r),
                   g_um.at_wake ? ", if the process allocates any," : "");
        }
    }
    pthread_mutex_unlock(&g_um.mu);
}

/* A paused or finished census: the counters' kind off (and on again), as every other kind. */
static void um_switch(int on)
{
    pthread_mutex_lock(&g_um.mu);
    if (atomic_load(&g_um.state) > 0 && on != g_um.kind_on) {   /* never disabled twice */
        CUptiResult r = on ? gc_cupti_enable(CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER)
                           : gc_cupti_disable(CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER);
        if (r == CUPTI_SUCCESS) g_um.kind_on = on;
    }
    pthread_mutex_unlock(&g_um.mu);
}

/* A managed-memory call CUPTI reported (driver API, its exit): counted as the default collector's wrappers count it,
 * and the first allocation turns the counters on. */
static void managed_callback(int call, const CUpti_CallbackData *cb)
{
    if (cb->callbackSite != CUPTI_API_EXIT || !cb->functionParams ||
        (cb->functionReturnValue && *(const CUresult *)cb->functionReturnValue != CUDA_SUCCESS))
        return;
    uint32_t dev = 0;
    int d = cb->context && gc_cupti_device_of(cb->context, &dev) == CUPTI_SUCCESS ? (int)dev : -1;
    gc_managed_call(call, cb->functionParams, d);
    if (gc_managed_any() && atomic_load(&g_state) == ACTIVE) um_enable();
}

static int want_managed(CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const char *name)
{
    (void)name;
    return dom == CUPTI_CB_DOMAIN_DRIVER_API && gc_managed_cbid(cbid) != GC_M_NONE;
}

/* ---- the flusher: totals at most one period stale, and a known "complete up to" time ---- */

/* Every period: note the time, have CUPTI hand back every buffer whose records are complete, then
 * publish that time. Readers (the proxy) then know that GPU work which finished before it is in the
 * totals, also on an idle server where no buffer fills. Runs on its own thread with all signals
 * blocked; it never touches the server's threads. */
static void disable_kinds(void)
{
    for (int i = 0; i < g_nkinds; i++) kind_set(g_kinds[i], 0);
}

/* The census ends (failed, or finished by the server): nothing more is recorded, from any context. */
static void disable_kinds_for_good(void)
{
    gc_launches_set_counting(0);
    gc_calls_set_counting(0);
    disable_kinds();
    um_switch(0);
    if (g_kernel_global && gc_cupti_disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) == CUPTI_SUCCESS)
        g_kernel_global = 0;
}


static void sleep_until(uint64_t mono)
{
    struct timespec ts = {(time_t)(mono / 1000000000ull), (long)(mono % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {}
}

static void control_poll(uint64_t mono);
static int finish(int at_exit);

/* Launches counted since the last fold into the segment (made now if they are the first thing to
 * count), at every wake of the flusher: far more often than the window ring's 41 s. Nothing to fold
 * (every kernel traced, an idle server): no lock, no update. */
static void fold_launches(uint64_t mono)
{
    if (atomic_load(&g_state) != ACTIVE || (!gc_launches_pending() && !gc_calls_pending() && !gc_managed_pending()))
        return;
    pthread_mutex_lock(&g_mu);
    gc_segment *seg = atomic_load(&g_state) == ACTIVE ? segment() : NULL;
    if (seg) {
        gc_segment_begin_update(seg);
        gc_launches_fold(g_tally, seg, mono);
        gc_calls_fold(g_tally, seg);
        gc_managed_publish(seg);
        if (g_calls) fill_uuids(seg); /* no buffer ever completes to do it (else: zeros) */
        gc_segment_end_update(seg);
    }
    pthread_mutex_unlock(&g_mu);
}

/* ACTIVITY=events: the pairs done since the last wake (graph spans went to their execs' means in graphs.c, before
 * the launches they price are folded); eager ones are samples of their device and window. The flusher's only: its
 * thread is the one events.c put in relaxed capture mode. */
static struct gc_event_sample g_samples[GC_EVENTS_MAX_PENDING];

static void poll_events(void)
{
    size_t n = gc_events_poll(g_samples, GC_EVENTS_MAX_PENDING);
    if (!n) return;
    pthread_mutex_lock(&g_mu);
    gc_segment *seg = atomic_load(&g_state) == ACTIVE ? segment() : NULL;
    if (seg) {
        gc_segment_begin_update(seg);
        for (size_t i = 0; i < n; i++) gc_tally_eager_sample(g_tally, g_samples[i].dev, g_samples[i].t_ns, g_samples[i].ns);
        gc_segment_end_update(seg);
    }
    pthread_mutex_unlock(&g_mu);
}

/* Contexts learned since the last wake get the kernel kind's state now (until then they had the global
 * one: on, their records outside a traced phase are left out by the tally). They are learned later only
 * where contexts are followed, and there the kind never goes off globally while none is known
 * (kernel_kind); a global enable here was measured not to help. */
static void new_contexts(void)
{
    if (g_calls || g_ctx_refused || !gc_contexts_new()) return; /* ACTIVITY=off: no kind to switch */
    (void)gc_contexts_switch(g_kind_on[CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL], 1, g_kernel_global);
}

static void *flusher(void *arg)
{
    (void)arg;
    const uint64_t period = (uint64_t)g_cfg.flush_ms * 1000000ull;
    uint64_t next_flush = gc_mono_ns() + period;
    /* ACTIVITY=off: the calls' queue is emptied every CALLS_FOLD_NS (bounded, never waited on) */
    const uint64_t CALLS_FOLD_NS = 20000000ull;
    for (;;) {
        uint64_t wake = next_flush;
        if (g_calls && wake > gc_mono_ns() + CALLS_FOLD_NS) wake = gc_mono_ns() + CALLS_FOLD_NS;
        sleep_until(wake);
        if (getpid() != g_pid) break;
        int st = atomic_load(&g_state);
        if (st == FAILED) { /* outside any CUPTI callback: safe to stop the tracing */
            disable_kinds_for_good();
            break;
        }
        if (st != ACTIVE) break;
        atomic_store(&g_flusher_busy, 1);
        uint64_t now = gc_mono_ns();
        if (g_um.at_wake) um_enable();
        if (g_events) poll_events();
        fold_launches(now);
        if (atomic_load(&g_state) == ACTIVE) new_contexts();
        if (atomic_load(&g_state) == ACTIVE && now >= next_flush) {
            next_flush = now - next_flush < period ? next_flush + period : now + period;
            control_poll(now);
            if (g_ctl.finish) { /* asked for by the control file: the census ends here */
                atomic_store(&g_flusher_busy, 0);
                (void)finish(0);
                break;
            }
            uint64_t t = gc_wall_ns();
            uint64_t m = gc_mono_ns();
            if (g_calls) fold_launches(m); /* every call made before t is in the totals now */
            if (g_calls || gc_cupti_flush_all(0) == CUPTI_SUCCESS) {
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

#define GC_FLUSHER_STACK (8u << 20)

/* The stack CUDA's own threads get (8 MiB, virtual: only the pages touched are memory). The flusher sets CUPTI up
 * on a live context, and CUPTI and the driver then need deep stacks: with 256 KiB llama-server
 * segfaulted in libcuda. */
static int start_flusher(void) { return gc_thread_start(flusher, GC_FLUSHER_STACK, "flusher thread"); }

/* ---- process life: exit and fork ---- */

/* The final flush: forced, every open busy interval committed, state exited. At exit, or earlier
 * through gc_finish() for servers that end their process without running atexit (vLLM's engine). */
/* Let a flush the flusher has begun end, for at most 200 ms: never hang an exit. */
static void wait_flusher_idle(void)
{
    for (int i = 0; i < 200 && atomic_load(&g_flusher_busy); i++) {
        struct timespec ms = {0, 1000000L};
        nanosleep(&ms, NULL);
    }
}

static int finish(int at_exit)
{
    int active = ACTIVE;
    if (getpid() != g_pid) return -1;
    if (!atomic_compare_exchange_strong(&g_state, &active, EXITING)) return -1;
    wait_flusher_idle(); /* the flusher starts no new flush now */
    if (g_events) gc_events_stop(at_exit);  /* at exit: no driver call; else the idle events destroyed */
    /* Forced: also returns buffers holding records of work still in flight. */
    uint64_t t = gc_wall_ns();
    if (!g_calls) gc_cupti_flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    pthread_mutex_lock(&g_mu);
    if (g_calls && (gc_launches_pending() || gc_calls_pending() || gc_managed_pending()))
        (void)segment(); /* counted, never folded yet */
    if (g_seg) {
        gc_segment_begin_update(g_seg);
        gc_launches_fold(g_tally, g_seg, gc_mono_ns());
        gc_calls_fold(g_tally, g_seg);
        gc_tally_publish(g_tally, 1);
        g_seg->complete_wall_ns = t;
        publish_kernels(g_seg, gc_mono_ns());
        count_losses(g_seg, NULL, 0);
        g_seg->state = GC_STATE_EXITED;
        gc_segment_end_update(g_seg);
        msync(g_seg, sizeof(*g_seg), MS_ASYNC);
    }
    atomic_store(&g_state, OFF);
    pthread_mutex_unlock(&g_mu);
    /* Called by the server (not at exit, where CUPTI may be going down too): nothing will count the
     * records now, so stop paying CUPTI for the rest of the process's life. */
    if (!at_exit) disable_kinds_for_good();
    return 0;
}

static void at_exit(void) { (void)finish(1); }

static void at_fork_child(void)
{
    /* CUDA is unusable in a child forked after init and CUPTI's threads did not come along.
     * Drop our view of the parent's segment; an exec'd CUDA program gets its own census. */
    atomic_store(&g_state, OFF);
    gc_interpose_stop();
    gc_events_forget();
    gc_launches_set_counting(0);
    gc_calls_set_counting(0);
    gc_contexts_forget();
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    g_mu = fresh; /* the parent's CUPTI thread may have held it at fork time */
    if (g_seg) munmap(g_seg, sizeof(*g_seg));
    g_seg = NULL;
    g_tally = NULL; /* the parent's heap copy: leaked on purpose, freeing it is not our business */
    atomic_store(&g_path_set, 0);
    g_path[0] = 0;
}

/* ---- kinds ---- */

static int kind_index(CUpti_ActivityKind k)
{
    for (int i = 0; i < g_nkinds; i++)
        if (g_kinds[i] == k) return i;
    return -1;
}

/* Enable a kind and remember it (to disable it when we fail or pause). */
static CUptiResult add_kind(CUpti_ActivityKind k)
{
    if (kind_index(k) >= 0) return CUPTI_SUCCESS;
    CUptiResult r = g_ctl.paused ? CUPTI_SUCCESS : kind_set(k, 1);
    if (r == CUPTI_SUCCESS) g_kinds[g_nkinds++] = k;
    return r;
}

static void enable_kinds(void)
{
    for (int i = 0; i < g_nkinds; i++) kind_set(g_kinds[i], 1);
}

/* ---- the control file: switch a running census without restarting its server ---- */

/* <segment>.control beside the segment (the census folder is the user's own, checked at start), read by the flusher
 * at every wake. Space-separated words: `census=off` stops counting (the default collector's wrappers pass calls
 * through; CUPTI's kinds are disabled, though CUPTI stays set up), `census=on` counts again, and `census=finish` runs
 * the final flush now, on the flusher thread, and ends the census (for a process about to be killed whose own
 * shutdown may never run: vLLM's engine, SGLang's schedulers). The segment says whether it is paused and for how
 * long it was. */
static void control_poll(uint64_t mono)
{
    /* What this file said that was not applied is told in one line per change of the file, and such lines
     * at most every CONTROL_LOG_S seconds (how many were held back is told in the next): whoever rewrites the
     * file in a loop must not flood the server's stderr. Words are quoted as gc_log writes everything:
     * bytes outside printable ASCII escaped. */
    enum { CONTROL_LOG_S = 10 };
    static uint64_t next_log_ns;
    static unsigned held_lines;
    static struct stat refused; /* the file last refused whole (too long, a NUL byte): one complaint */
    if (!atomic_load_explicit(&g_path_set, memory_order_acquire)) return; /* no segment yet: no control file */
    size_t len = strlen(g_path);
    if (len < 4 || strcmp(g_path + len - 4, ".seg") != 0) return;
    char path[sizeof(g_path) + 8];
    snprintf(path, sizeof(path), "%.*s.control", (int)(len - 4), g_path);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return;
    struct stat st;
    char buf[sizeof(g_ctl.last)];
    ssize_t n = -1;
    int ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == getuid();
    if (ok && st.st_size < (off_t)sizeof(buf)) n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (!ok) return;
    const char *whole = n < 0 && st.st_size >= (off_t)sizeof(buf) ? "longer than the 127 bytes it reads"
                        : n > 0 && memchr(buf, 0, (size_t)n) ? "it holds a NUL byte"
                                                             : NULL;
    int pause = g_ctl.paused;
    char said[400] = ""; /* what was not applied, and why */
    if (whole) {
        int same = refused.st_ino == st.st_ino && refused.st_size == st.st_size &&
                   refused.st_mtim.tv_sec == st.st_mtim.tv_sec && refused.st_mtim.tv_nsec == st.st_mtim.tv_nsec;
        refused = st;
        if (same) return;
        snprintf(said, sizeof(said), "ignored (%s; census=on|off|finish)", whole);
    } else {
        if (n < 0) return;
        memset(&refused, 0, sizeof(refused));
        buf[n] = 0;
        if (strcmp(buf, g_ctl.last) == 0) return;
        memcpy(g_ctl.last, buf, (size_t)n + 1);
        size_t said_n = 0;
#define IGNORE(word, why)                                                                                          \
    do {                                                                                                           \
        if (said_n < sizeof(said)) {                                                                               \
            int k = snprintf(said + said_n, sizeof(said) - said_n, "%s\"%.40s\" (%s)", said_n ? "; " : "ignoring ", \
                             word, why);                                                                           \
            if (k > 0) said_n += (size_t)k;                                                                        \
        }                                                                                                          \
    } while (0)
        char *save = NULL;
        for (char *w = strtok_r(buf, " \t\r\n", &save); w; w = strtok_r(NULL, " \t\r\n", &save)) {
            if (strcmp(w, "census=finish") == 0) g_ctl.finish = 1;
            else if (strcmp(w, "census=off") == 0) pause = 1;
            else if (strcmp(w, "census=on") == 0) pause = 0;
            else IGNORE(w, "census=on|off|finish");
        }
#undef IGNORE
    }
    if (said[0] && mono >= next_log_ns) {
        char more[64] = "";
        if (held_lines) snprintf(more, sizeof(more), " (%u more such lines since the last)", held_lines);
        gc_log("control file %s: %s%s", path, said, more);
        next_log_ns = mono + (uint64_t)CONTROL_LOG_S * 1000000000ull;
        held_lines = 0;
    } else if (said[0]) {
        held_lines++;
    }
    if (whole) return;
    pthread_mutex_lock(&g_mu);
    int switched = pause != g_ctl.paused;
    if (switched) {
        gc_launches_set_counting(!pause);
        gc_calls_set_counting(!pause);
        if (pause) {
            disable_kinds();
            g_ctl.paused_since = mono;
        } else {
            enable_kinds();
            g_ctl.paused_ns += mono - g_ctl.paused_since;
        }
        g_ctl.paused = pause;
    }
    pthread_mutex_unlock(&g_mu);
    if (switched) um_switch(!pause);   /* outside g_mu: its lock is held by a callback thread inside CUPTI */
}

/* Every CUPTI callback we enable lands here: graph contents first (a launch notes its graph's version),
 * then steps (a launch notes its step). */
static void CUPTIAPI on_api(void *ud, CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const void *data)
{
    (void)ud;
    if (dom == CUPTI_CB_DOMAIN_RESOURCE && cbid == CUPTI_CBID_RESOURCE_CONTEXT_CREATED) {
        atomic_fetch_add(&g_contexts_late, 1);
        gc_contexts_add(((const CUpti_ResourceData *)data)->context);
        return;
    }
    if (dom == CUPTI_CB_DOMAIN_RESOURCE && cbid == CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING) {
        gc_contexts_remove(((const CUpti_ResourceData *)data)->context);
        return;
    }
    int call = dom == CUPTI_CB_DOMAIN_DRIVER_API ? gc_managed_cbid(cbid) : GC_M_NONE;
    if (call != GC_M_NONE) {   /* no graph or step cares for these */
        managed_callback(call, data);
        return;
    }
    gc_graphs_callback(dom, cbid, data);
    gc_steps_callback(dom, data);
}

/* ---- start ---- */

static void follow_contexts(void);
static void follow_managed(void);

/* The default collector: the calls the library preloaded sees (interpose.c), counted by launches.c, calls.c and
 * graphs.c; kernel time from event pairs (events.c) unless ACTIVITY=off; CUPTI never loaded. 0: counting so. */
static int start_calls(void)
{
    uint64_t m = gc_mono_ns(), w = gc_wall_ns();
    /* No CUPTI clock: the census clock is CLOCK_REALTIME (clock_ref_gpu_ns 0 maps it one to one), read through
     * CLOCK_MONOTONIC as launches.c does. */
    g_gpu_minus_mono = (int64_t)(w - m);
    g_clock_ref_gpu = 0;
    const char *why = gc_graphs_start() != 0 ? "graph contents cannot be learned"
                    : gc_launches_start(g_gpu_minus_mono) != 0 ? "launches cannot be counted"
                    : gc_calls_start(g_gpu_minus_mono) != 0 ? "copies cannot be counted" : NULL;
    if (why) {
        gc_log("the default collector cannot count here (%s); counting through CUPTI's activity API", why);
        return 1;
    }
    gc_steps_marks(gc_launches_step_push, gc_launches_step_pop);
    gc_interpose_start();
    g_calls = 1;
    /* event pairs around a sample of the launches, from the first launch on */
    if (g_cfg.timing &&
        gc_events_start(g_cfg.events_every_eager, g_cfg.events_every_graph, g_cfg.events_gate) == 0)
        g_events = 1;
    g_graphs_learned = 1;
    g_graph_mode = GC_GRAPHS_LAUNCH;
    g_collector = GC_COLLECTOR_DEFAULT;
    return 0;
}

/* The collector in force: the default one where the library is preloaded (start_calls), else, or where that cannot
 * count, the precise one: CUPTI's records of every kernel, copy and memset (measured durations, busy time), graphs
 * per launch where CUPTI allows it (their contents learned through its callbacks), else node by node. */
static int start(void)
{
    if (g_preload) {   /* the calls are the preloaded interposer's: CUPTI only if that cannot count */
        if (start_calls() == 0) return 0;
        g_preload = 0;
        if (gc_cupti_load(g_cfg.cupti_path) != 0) return -1;
    }
    if (gc_cupti_subscribe(g_cfg.api_v1) != 0) return -1;
    CUptiResult r = gc_cupti_register(on_request, on_complete);
    if (r != CUPTI_SUCCESS) {
        gc_log("census off: cannot register activity buffers: %s", gc_cupti_error(r));
        return -1;
    }
    g_collector = GC_COLLECTOR_PRECISE;
    gc_cupti_set_api_callback(on_api);
    /* Graphs per launch (GRAPH_TRACE). Drivers before r610 refuse it to the v2 (multi-subscriber) API,
     * where they also give activity records to one subscriber only: then, unless the API was named,
     * take the v1 path, which allows it (its callbacks hold CUPTI's one subscriber slot). */
    if (g_cfg.graph_mode == GC_GRAPHS_LAUNCH && gc_cupti_is_v2() && !g_cfg.api_named) {
        r = gc_cupti_enable(CUPTI_ACTIVITY_KIND_GRAPH_TRACE);
        if (r == CUPTI_SUCCESS) {
            gc_cupti_disable(CUPTI_ACTIVITY_KIND_GRAPH_TRACE);
        } else {
            if (gc_cupti_downgrade_v1() != 0) return -1;
            if ((r = gc_cupti_register(on_request, on_complete)) != CUPTI_SUCCESS) {
                gc_log("census off: cannot register activity buffers: %s", gc_cupti_error(r));
                return -1;
            }
        }
    }
    /* Graph contents are learned through callbacks: under the v1 API they hold CUPTI's one slot. */
    g_graph_mode = GC_GRAPHS_NODE;
    if (g_cfg.graph_mode == GC_GRAPHS_LAUNCH && gc_graphs_start() == 0 && gc_cupti_graphs_follow() == 0) {
        g_graphs_learned = 1;
        g_graph_mode = GC_GRAPHS_LAUNCH;
    }
    /* No EXTERNAL_CORRELATION kind: CUPTI emits those only beside API records (steps.c says why). */
    const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                        CUPTI_ACTIVITY_KIND_MEMCPY2, CUPTI_ACTIVITY_KIND_MEMSET};
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        r = add_kind(kinds[i]);
        if (r != CUPTI_SUCCESS) {
            gc_log("census off: cannot enable activity kind %d: %s", (int)kinds[i], gc_cupti_error(r));
            disable_kinds(); /* the ones already on */
            return -1;
        }
    }
    /* Refused per-launch records leave graphs traced node by node: slower, still exact (the segment says which). */
    if (g_graph_mode == GC_GRAPHS_LAUNCH && (r = add_kind(CUPTI_ACTIVITY_KIND_GRAPH_TRACE)) != CUPTI_SUCCESS) {
        if (g_cfg.graph_named)
            gc_log("graphs traced node by node: CUPTI refused per-launch graph records (%s)", gc_cupti_error(r));
        g_graph_mode = GC_GRAPHS_NODE;
        g_graphs_learned = 0;
    }
    uint64_t m0 = gc_mono_ns();
    CUptiResult tr;
    uint64_t ts = gc_cupti_timestamp(&tr);
    g_clock_ref_gpu = ts;
    uint64_t m1 = gc_mono_ns();
    g_gpu_minus_mono = (int64_t)(ts - (m0 + (m1 - m0) / 2));
    follow_contexts();
    follow_managed();
    return 0;
}

/* ---- when CUPTI is set up: inside cuInit, so that nothing the process puts on the GPU goes uncounted ---- */

/* Contexts made from now on and going away: late contexts counted, the kernel kind switched per
 * context. Under the v1 API a callback takes CUPTI's one slot: only where callbacks are in use already
 * (graphs per launch, counted launches). start()'s, before it switches any kind off. */
static void follow_contexts(void)
{
    if (gc_cupti_is_v2() || g_graphs_learned) {
        if (gc_cupti_enable_resource("contexts not followed", CUPTI_CBID_RESOURCE_CONTEXT_CREATED) == 0)
            g_contexts_followed =
                gc_cupti_enable_resource("contexts not followed", CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING) == 0;
    }
}

/* Managed allocations seen through CUPTI's callbacks where callbacks are in use already (as contexts are): the
 * counters then go on at the first one; else at the flusher's first wake, whatever the process allocates. */
static void follow_managed(void)
{
    if ((gc_cupti_is_v2() || g_graphs_learned) &&
        gc_cupti_enable_api("managed memory not followed", GC_CB_MANAGED, want_managed) > 0)
        return;
    g_um.at_wake = 1;
}

int InitializeInjection(void)
{
    static atomic_int once;
    if (atomic_exchange(&once, 1)) return 1;
    if (gc_config_disabled()) return 1;
    gc_config_load(&g_cfg);
    g_pid = getpid();
    g_start_wall = gc_wall_ns();
    g_env_unified = getenv("GGML_CUDA_ENABLE_UNIFIED_MEMORY") != NULL;   /* set at all: llama.cpp asks no more */
    /* The default collector is the library preloaded (counting at the calls, CUPTI never loaded); without it the
     * census says so in one line and takes CUPTI's records, exact, rather than counting nothing. */
    g_preload = g_cfg.calls && gc_interpose_ready();
    if (g_cfg.calls && !g_preload) {
        const char *lp = getenv("LD_PRELOAD");
        if (lp && strstr(lp, "otel_gpu_census"))
            gc_log("the default collector: LD_PRELOAD names the census library, but no driver function was looked up "
                   "through this copy of it before cuInit (LD_PRELOAD and CUDA_INJECTION64_PATH name different files?); "
                   "counting through CUPTI's activity API (the precise collector)");
        else
            gc_log("the default collector needs the census library preloaded (LD_PRELOAD, as `run` and `otel-gpu-census "
                   "env` set it); counting through CUPTI's activity API (the precise collector)");
        g_cfg.calls = g_cfg.timing = 0;
    }
    if (!g_preload && gc_cupti_load(g_cfg.cupti_path) != 0) return 1; /* 1 either way: the driver carries on */
    pthread_atfork(NULL, NULL, at_fork_child);
    atexit(at_exit);
    if (start() != 0) return 1;
    atomic_store(&g_state, ACTIVE);
    /* Our flusher, else CUPTI's own periodic flush (no "complete up to" time then). */
    if (start_flusher() != 0) {
        if (g_calls) gc_log("no flusher thread: calls are counted at exit only (the default collector)");
        else gc_cupti_flush_period(g_cfg.flush_ms);
    }
    return 1;
}

/* ---- C API for callers inside the process ---- */

uint32_t gc_layout_version(void) { return GC_LAYOUT_VERSION; }

int gc_active(void) { return atomic_load(&g_state) == ACTIVE && getpid() == g_pid; }
/* (EXITING and FAILED count as not active: no new steps, no forced flushes from callers.) */

int gc_step_begin(uint64_t id)
{
    if (!gc_active() || id == 0 || id > UINT32_MAX) return -1;
    if (gc_steps_start(g_calls ? NULL : gc_cupti_steps_follow) != 0) return -1;
    return gc_steps_push(id);
}

int gc_step_end(uint64_t *id)
{
    /* pops also after the census stopped: a caller's begin/end pairs stay balanced */
    if (getpid() != g_pid) return -1;
    return gc_steps_pop(id);
}

int gc_flush(void)
{
    if (!gc_active()) return -1;
    if (!g_calls && gc_cupti_flush_all(0) != CUPTI_SUCCESS) return -1;
    fold_launches(gc_mono_ns());
    return 0;
}

int gc_finish(void) { return finish(0); }

/* Another thread may be writing the path while the segment is made: "" until it is whole. */
const char *gc_segment_path(void) { return atomic_load_explicit(&g_path_set, memory_order_acquire) ? g_path : ""; }
