/*
 * events.c - kernel durations from CUDA event pairs around a sample of the launches the preloaded wrappers see
 * (OTEL_GPU_CENSUS_ACTIVITY=events). No CUPTI at all.
 *
 * Why: counting at the calls (interpose.c) costs vLLM nothing measurable but measures no duration (§22), and
 * CUPTI, once set up for durations, taxes every launch of the process for good: its detach crashes CUDA-graph
 * programs on the H200 (§23). An event pair costs only the launches it brackets. So about 1 of every `graph` graph
 * launches (every one by default) and of every `eager` eager launches (none by default: below) of each thread get
 * cuEventRecord before and after the call, on the launch's stream; the flusher reads the pairs that completed
 * (cuEventQuery, cuEventElapsedTime) every wake.
 * An eager pair's time is a sample of eager kernel duration (priced as COUNTED prices eager launches); a graph
 * pair's joins its exec version's mean span (graphs.c), which prices every launch of that version.
 *
 * Which launches: each thread counts down a random gap, uniform in [1, 2N-1] launches (N on average), to its next
 * sampled one. A fixed stride aliases with a server's regular launch sequence (vLLM launches the same kernels in
 * the same order every step: 1 in every 128 took the same few of them, §24).
 *
 * What a pair measures: from the GPU reaching the first event to the launch's work done. If the stream is busy,
 * the first event fires as the work before it ends and the kernel starts right after it: the pair is the kernel's
 * time. If it is idle, the first event fires at once and the kernel only when the launch call has submitted it, so
 * the pair also holds the call (and whatever held the thread up): on the H200 such pairs read several times
 * CUPTI's durations (§24), and even pairs whose first event had not fired when the call returned read several
 * times CUPTI's on an idle GPU (whose front end had simply not reached it yet). So eager launches are not timed by
 * default, and their time is left unknown. Asked for, right after an eager launch call returns the launching
 * thread asks whether the first
 * event has fired (cuEventQuery, in relaxed capture mode for that one call): not yet, the stream was busy and the
 * pair is the eager sample; already, it was idle and the pair is summed apart (events_idle), the reader's last
 * resort when a process has no other. A graph launch submits its nodes during the call: its pair is its span as it
 * stands (an idle stream's holds the submission too: +5.7 % a launch on vLLM, §24).
 *
 * Safety: nothing is recorded while any stream capture is open (an event recorded into a capturing stream
 * becomes a graph node), and the flusher's thread is switched to relaxed capture mode, so its queries can never
 * invalidate another thread's capture. Pools are per context, fixed in size (memory bounded); a pair is taken
 * lock-free by the launching thread (FREE -> BUSY -> PENDING), read and freed by the flusher under ev.mu. A
 * context about to be destroyed or released (interpose.c's wrappers, before the driver's call) has its pools'
 * events destroyed first under ev.mu; a pair in flight on another thread then is given back by its thread with its
 * events forgotten (they went with their context), never read.
 * At exit nothing calls the driver; a forked child forgets everything.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include <cuda.h>

#include "internal.h"

#define EV_POOLS 8       /* contexts followed at once */
#define EV_PAIRS 256     /* pairs a context: ~20 ms of a busy server's samples, read every flusher wake */

enum { P_FREE = 0, P_BUSY, P_PENDING };

struct pair {
    _Atomic int state;
    uint32_t gen;         /* the pool's generation it was taken in: another one means its context went */
    CUevent a, b;         /* created in the pool's context by the first thread that takes the pair */
    uint8_t graph;
    uint32_t dev, corr;   /* corr: a graph launch's, for its exec's span (graphs.c) */
    uint8_t idle;         /* an eager pair whose first event had fired when its launch call returned */
    uint64_t t_ns;        /* the launch, census clock */
};

struct pool {
    _Atomic(CUcontext) ctx;   /* NULL: unused */
    int dev;
    _Atomic uint32_t gen;
    _Atomic uint32_t cursor;
    struct pair p[EV_PAIRS];
};


static struct {
    CUresult (*create)(CUevent *, unsigned int);
    CUresult (*record)(CUevent, CUstream);
    CUresult (*query)(CUevent);
    CUresult (*elapsed)(float *, CUevent, CUevent);
    CUresult (*destroy)(CUevent);
    CUresult (*push)(CUcontext);
    CUresult (*pop)(CUcontext *);
    CUresult (*exchange_mode)(CUstreamCaptureMode *);
} drv;

static struct {
    atomic_int on;
    uint32_t every_eager, every_graph;
    pthread_mutex_t mu;             /* the flusher's reads, a context going, a new pool */
    int relaxed;                    /* the flusher's thread was put in relaxed capture mode */
    struct pool pools[EV_POOLS];
} ev = {.mu = PTHREAD_MUTEX_INITIALIZER};

static struct { _Atomic uint64_t timed, missed, failed, idle, idle_ns; } g_st;
static _Atomic uint32_t g_ctx_gen;  /* moves whenever a context goes: threads look their pool up again */
static __thread uint32_t t_left[2], t_rng;   /* launches to the next sampled one; the thread's xorshift state */
static __thread CUcontext t_ctx;
static __thread int t_pool = -1;
static __thread uint32_t t_gen;

#define RESOLVE(field, ...) (*(void **)&drv.field = first(cuda, (const char *[]){__VA_ARGS__, NULL}))

static void *first(void *lib, const char **names)
{
    for (; *names; names++) {
        void *p = dlsym(lib, *names);
        if (p) return p;
    }
    return NULL;
}

int gc_events_start(uint32_t every_eager, uint32_t every_graph)
{
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!cuda) return -1;
    RESOLVE(create, "cuEventCreate");
    RESOLVE(record, "cuEventRecord");
    RESOLVE(query, "cuEventQuery");
    RESOLVE(elapsed, "cuEventElapsedTime_v2", "cuEventElapsedTime");
    RESOLVE(destroy, "cuEventDestroy_v2", "cuEventDestroy");
    RESOLVE(push, "cuCtxPushCurrent_v2", "cuCtxPushCurrent");
    RESOLVE(pop, "cuCtxPopCurrent_v2", "cuCtxPopCurrent");
    RESOLVE(exchange_mode, "cuThreadExchangeStreamCaptureMode");
    dlclose(cuda);   /* NOLOAD took a reference of a library the process keeps */
    if (!drv.create || !drv.record || !drv.query || !drv.elapsed || !drv.destroy || !drv.push || !drv.pop ||
        !drv.exchange_mode) {
        gc_log("kernel time not measured: the driver lacks the event calls (OTEL_GPU_CENSUS_ACTIVITY=events); "
               "counts are exact");
        return -1;
    }
    if (gc_graphs_timed_start() != 0) {
        gc_log("kernel time not measured: no memory for the graph table; counts are exact");
        return -1;
    }
    ev.every_eager = every_eager;   /* 0: no eager launch is timed */
    ev.every_graph = every_graph ? every_graph : 1;
    atomic_store(&ev.on, 1);
    return 0;
}

/* The calling thread's pool for context `c` (-1: none free). A new one under ev.mu, rarely. */
static int pool_of(CUcontext c, int dev)
{
    uint32_t gen = atomic_load_explicit(&g_ctx_gen, memory_order_acquire);
    if (c == t_ctx && t_pool >= 0 && gen == t_gen) return t_pool;
    int found = -1;
    for (int i = 0; i < EV_POOLS && found < 0; i++)
        if (atomic_load_explicit(&ev.pools[i].ctx, memory_order_acquire) == c) found = i;
    if (found < 0) {
        pthread_mutex_lock(&ev.mu);
        for (int i = 0; i < EV_POOLS && found < 0; i++)
            if (atomic_load(&ev.pools[i].ctx) == c) found = i;
        for (int i = 0; i < EV_POOLS && found < 0; i++)
            if (!atomic_load(&ev.pools[i].ctx)) {
                ev.pools[i].dev = dev;
                atomic_store(&ev.pools[i].ctx, c);
                found = i;
            }
        pthread_mutex_unlock(&ev.mu);
    }
    t_ctx = c, t_pool = found, t_gen = gen;
    return found;
}

/* Whether this launch of the calling thread is one of the sample: every launch pays this and nothing more. */
int gc_events_tick(int graph)
{
    if (!atomic_load_explicit(&ev.on, memory_order_relaxed)) return 0;
    if (t_left[graph] > 1) {
        t_left[graph]--;
        return 0;
    }
    uint32_t every = graph ? ev.every_graph : ev.every_eager;
    if (every == 0) return 0;
    if (every == 1) {
        t_left[graph] = 1;
        return 1;
    }
    if (!t_rng) t_rng = ((uint32_t)(uintptr_t)&t_rng ^ (uint32_t)gc_mono_ns()) | 1u;
    t_rng ^= t_rng << 13, t_rng ^= t_rng >> 17, t_rng ^= t_rng << 5;
    t_left[graph] = 1 + t_rng % (2 * every - 1);
    return 1;
}

int gc_events_before(CUstream s, CUcontext c, int dev)
{
    /* an event recorded into a capturing stream would be a node of its graph: none while any capture is open */
    if (!c || dev < 0 || gc_launches_any_capture()) return -1;
    int pi = pool_of(c, dev);
    if (pi < 0) { atomic_fetch_add_explicit(&g_st.missed, 1, memory_order_relaxed); return -1; }
    struct pool *pl = &ev.pools[pi];
    uint32_t start = atomic_fetch_add_explicit(&pl->cursor, 1, memory_order_relaxed);
    for (uint32_t k = 0; k < 8; k++) {
        struct pair *p = &pl->p[(start + k) % EV_PAIRS];
        int free_ = P_FREE;
        if (atomic_load_explicit(&p->state, memory_order_relaxed) != P_FREE ||
            !atomic_compare_exchange_strong_explicit(&p->state, &free_, P_BUSY, memory_order_acquire,
                                                     memory_order_relaxed))
            continue;
        uint32_t gen = atomic_load_explicit(&pl->gen, memory_order_acquire);
        if (p->gen != gen) p->a = p->b = NULL;   /* made in a context that went: gone with it */
        p->gen = gen;
        if ((!p->a && drv.create(&p->a, CU_EVENT_DEFAULT) != CUDA_SUCCESS) ||
            (!p->b && drv.create(&p->b, CU_EVENT_DEFAULT) != CUDA_SUCCESS) || drv.record(p->a, s) != CUDA_SUCCESS) {
            atomic_fetch_add_explicit(&g_st.failed, 1, memory_order_relaxed);
            atomic_store_explicit(&p->state, P_FREE, memory_order_release);
            return -1;
        }
        return pi * EV_PAIRS + (int)((start + k) % EV_PAIRS);
    }
    atomic_fetch_add_explicit(&g_st.missed, 1, memory_order_relaxed);
    return -1;
}

void gc_events_after(int slot, CUstream s, int ok, uint32_t corr, int dev)
{
    if (slot < 0) return;
    struct pool *pl = &ev.pools[slot / EV_PAIRS];
    struct pair *p = &pl->p[slot % EV_PAIRS];
    if (p->gen != atomic_load_explicit(&pl->gen, memory_order_acquire)) { /* its context went, its events with it */
        p->a = p->b = NULL;
        atomic_store_explicit(&p->state, P_FREE, memory_order_release);
        return;
    }
    p->idle = 0;
    if (ok && !corr) { /* an eager launch: had the GPU reached the first event before the kernel was submitted? */
        CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;   /* never an unsafe call for a capture elsewhere */
        if (drv.exchange_mode(&m) == CUDA_SUCCESS) {
            p->idle = drv.query(p->a) != CUDA_ERROR_NOT_READY;
            drv.exchange_mode(&m);
        } else {
            p->idle = 1;   /* not known: not the sample */
        }
    }
    if (!ok || drv.record(p->b, s) != CUDA_SUCCESS) {
        if (ok) atomic_fetch_add_explicit(&g_st.failed, 1, memory_order_relaxed);
        atomic_store_explicit(&p->state, P_FREE, memory_order_release);
        return;
    }
    p->graph = corr != 0;
    p->corr = corr;
    p->dev = (uint32_t)dev;
    p->t_ns = gc_wall_ns();
    atomic_store_explicit(&p->state, P_PENDING, memory_order_release);
}

size_t gc_events_poll(struct gc_event_sample *out, size_t max)
{
    size_t n = 0;
    if (!atomic_load(&ev.on) || pthread_mutex_trylock(&ev.mu) != 0) return 0;
    if (!ev.relaxed) { /* this thread's queries never count as unsafe calls during another thread's capture */
        CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
        ev.relaxed = drv.exchange_mode(&m) == CUDA_SUCCESS ? 1 : -1;
        if (ev.relaxed < 0) /* a query could break a capture elsewhere: none is made, every sampled launch is missed */
            gc_log("kernel time not measured: the flusher's thread cannot be put in relaxed capture mode; counts are "
                   "exact");
    }
    for (int i = 0; i < EV_POOLS && ev.relaxed > 0; i++) {
        struct pool *pl = &ev.pools[i];
        CUcontext c = atomic_load(&pl->ctx);
        if (!c || drv.push(c) != CUDA_SUCCESS) continue;
        uint32_t gen = atomic_load(&pl->gen);
        for (int k = 0; k < EV_PAIRS; k++) {
            struct pair *p = &pl->p[k];
            if (atomic_load_explicit(&p->state, memory_order_acquire) != P_PENDING || p->gen != gen) continue;
            CUresult r = drv.query(p->b);
            if (r == CUDA_ERROR_NOT_READY) continue;
            float ms = 0;
            if (r == CUDA_SUCCESS && drv.elapsed(&ms, p->a, p->b) == CUDA_SUCCESS && ms >= 0) {
                uint64_t ns = (uint64_t)((double)ms * 1e6 + 0.5);
                atomic_fetch_add_explicit(&g_st.timed, 1, memory_order_relaxed);
                if (p->graph) {
                    gc_graphs_timed_span(p->corr, ns);
                } else if (p->idle) {
                    atomic_fetch_add_explicit(&g_st.idle, 1, memory_order_relaxed);
                    atomic_fetch_add_explicit(&g_st.idle_ns, ns, memory_order_relaxed);
                } else if (n < max) {
                    out[n++] = (struct gc_event_sample){p->dev, p->t_ns, ns};
                }
            } else {
                atomic_fetch_add_explicit(&g_st.failed, 1, memory_order_relaxed);
            }
            atomic_store_explicit(&p->state, P_FREE, memory_order_release);
        }
        CUcontext popped;
        drv.pop(&popped);
    }
    pthread_mutex_unlock(&ev.mu);
    return n;
}

/* The events of the pool's pairs that were made in generation `made` destroyed (under ev.mu, their context still
 * there), every pair not in flight free with none; a pair in flight is its thread's. */
static void destroy_events(struct pool *pl, uint32_t made)
{
    for (int k = 0; k < EV_PAIRS; k++) {
        struct pair *p = &pl->p[k];
        if (atomic_load(&p->state) == P_BUSY) continue;
        if (p->gen == made && p->a) drv.destroy(p->a);
        if (p->gen == made && p->b) drv.destroy(p->b);
        p->a = p->b = NULL;
        atomic_store(&p->state, P_FREE);
    }
}

/* Before the driver destroys a context (`is_ctx`: cuCtxDestroy of `v`) or releases or resets device `v`'s primary
 * one: that context's events are destroyed while they are still valid, and its pool is free again. */
void gc_events_context_going(int is_ctx, uintptr_t v)
{
    if (!atomic_load(&ev.on)) return;
    pthread_mutex_lock(&ev.mu);
    for (int i = 0; i < EV_POOLS; i++) {
        struct pool *pl = &ev.pools[i];
        CUcontext c = atomic_load(&pl->ctx);
        if (!c || (is_ctx ? (uintptr_t)c != v : (uintptr_t)(unsigned)pl->dev != v)) continue;
        destroy_events(pl, atomic_fetch_add(&pl->gen, 1));   /* a pair in flight on another thread is abandoned */
        atomic_store(&pl->ctx, NULL);
    }
    atomic_fetch_add_explicit(&g_ctx_gen, 1, memory_order_release);
    pthread_mutex_unlock(&ev.mu);
}

/* The census ends. At exit the driver may be going down: nothing is called. Else every idle event is destroyed. */
void gc_events_stop(int at_exit)
{
    atomic_store(&ev.on, 0);
    if (at_exit) return;
    pthread_mutex_lock(&ev.mu);
    for (int i = 0; i < EV_POOLS; i++) destroy_events(&ev.pools[i], atomic_load(&ev.pools[i].gen));
    pthread_mutex_unlock(&ev.mu);
}

void gc_events_forget(void)
{
    atomic_store(&ev.on, 0);
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    ev.mu = fresh; /* the parent's flusher may have held it at fork time; the parent's events are not ours */
}

void gc_events_stats(struct gc_events_stats *out)
{
    out->every_eager = ev.every_eager;
    out->every_graph = ev.every_graph;
    out->timed = atomic_load(&g_st.timed);
    out->missed = atomic_load(&g_st.missed);
    out->failed = atomic_load(&g_st.failed);
    out->idle = atomic_load(&g_st.idle);
    out->idle_ns = atomic_load(&g_st.idle_ns);
}
