/*
 * events.c - kernel durations from CUDA event pairs around a sample of the launches the preloaded wrappers see
 * (the default collector). No CUPTI at all.
 *
 * Why: counting at the calls (interpose.c) costs next to nothing but measures no duration, and CUPTI, once set
 * up for durations, taxes every launch of the process for good: its detach crashed CUDA-graph programs. An event
 * pair costs only the launches it brackets. So about 1 of every `graph` graph launches and of every `eager` eager
 * launches of each thread get cuEventRecord before and after the call, on the launch's stream; the flusher reads the
 * pairs that completed (cuEventQuery, cuEventElapsedTime) every wake. Every launch of a graph exec version is also timed until GRAPH_MIN_SPANS pairs have joined its mean, so a rarely launched
 * exec is priced by spans of its own, while one launched thousands of times a second pays a pair (a few µs on the
 * launching thread with its gate) for about 1 launch in `graph`.
 * An eager pair's time is a sample of eager kernel duration (priced as COUNTED prices eager launches); a graph
 * pair's joins its exec version's mean span (graphs.c), which prices every launch of that version.
 *
 * Which launches: each thread counts down a random gap, uniform in [1, 2N-1] launches (N on average), to its next
 * sampled one. A fixed stride aliases with a server's regular launch sequence (vLLM launches the same kernels in
 * the same order every step: 1 in every 128 took the same few of them).
 *
 * What a pair measures: from the GPU reaching the first event to the launch's work done. If the stream is busy,
 * the first event fires as the work before it ends and the kernel starts right after it: the pair is the kernel's
 * time. If it is idle, the first event fires at once and the kernel only when the launch call has submitted it, so
 * an ungated pair also holds the call (and whatever held the thread up): such pairs read several times CUPTI's
 * durations. Hence the gate (OTEL_GPU_CENSUS_EVENT_GATE=on, the default): before the first event the
 * stream is made to wait for a word of pinned host memory (cuStreamWaitValue32), which the launching thread writes
 * only once the launch and the second event are submitted. The GPU then meets event, kernel and event back to back,
 * whatever the stream held and however long the call took: the pair is the kernel, plus what the GPU takes to pass
 * two events. The cost: a sampled launch on an idle stream starts a few µs later (the second event's call and the
 * write), never while the stream had work ahead of it.
 * A gate the thread cannot open would stall its stream: the thread takes no lock of ours between wait and write,
 * but a call it makes there could wait for the whole context (a kernel's lazy loading at its first launch; another
 * thread's cudaFree holding the driver while the device drains). So the first sampled launch of each function or
 * graph exec is never gated (not timed), and a watchdog thread of ours that calls nothing but memory writes opens any
 * gate left shut for 10 ms (`events_forced`, that pair dropped): the worst a gate costs is a stream stalled 10-20 ms.
 * Ungated (EVENT_GATE=off, or a driver without stream memory operations), right after an eager launch call returns
 * the launching thread asks whether the first event has fired (cuEventQuery, in relaxed capture mode for that one
 * call): not yet, the pair is the eager sample; already, it was idle and the pair is summed apart (events_idle), the
 * reader's last resort when a process has no other. A graph launch submits its nodes during the call: an ungated
 * graph pair is its span as it stands (an idle stream's holds the submission too: a few per cent a launch on vLLM).
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
#include <sys/mman.h>
#include <time.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include <cuda.h>

#include "internal.h"

#define EV_POOLS 8       /* contexts followed at once */
#define EV_PAIRS 256     /* pairs a context: ~20 ms of a busy server's samples, read every flusher wake */
#define EV_SEEN 8192     /* functions and graph execs met by the sample: the first meeting is never gated */
#define GATE_FORCE_NS 10000000ull   /* a gate shut this long is opened by the watchdog */
#define GRAPH_MIN_SPANS 8u           /* every launch of an exec version is timed until its mean holds this many */
#define GATE_PAGES 64    /* pages of gate words made (one a context followed): beyond, new contexts go ungated */

enum { P_FREE = 0, P_BUSY, P_PENDING };

struct pair {
    _Atomic int state;
    uint32_t gen;         /* the pool's generation it was taken in: another one means its context went */
    CUevent a, b;         /* created in the pool's context by the first thread that takes the pair */
    CUevent lead;         /* gated eager pairs: an event just before `a`, timing the GPU's pass over one event */
    uint8_t led;          /* `lead` recorded for this use */
    uint8_t graph;
    uint32_t dev, corr;   /* corr: a graph launch's, for its exec's span (graphs.c) */
    uint8_t idle;         /* an eager pair whose first event had fired when its launch call returned */
    uint64_t t_ns;        /* the launch, census clock */
    uint32_t seq;         /* the gate's value for this use (its word holds the last use's until written) */
    uint8_t gated;        /* the stream waits for the word before the first event */
    _Atomic uint32_t open;   /* the seq of a gate still shut (0: none): the watchdog may open it */
    _Atomic uint64_t opened_ns;
};

struct pool {
    _Atomic(CUcontext) ctx;   /* NULL: unused */
    int dev;
    _Atomic uint32_t gen;
    _Atomic uint32_t cursor;
    _Atomic(uint32_t *) words;   /* the gate words: a page of ours, registered in the pool's context (NULL: none) */
    CUdeviceptr gate;            /* ... their address there (0: the pool is ungated) */
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
    CUresult (*wait_value)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
    CUresult (*host_register)(void *, size_t, unsigned int);
    CUresult (*host_device_ptr)(CUdeviceptr *, void *, unsigned int);
} drv;

static struct {
    atomic_int on;
    uint32_t every_eager, every_graph;
    atomic_int gate;                /* pairs are gated (EVENT_GATE=on and the driver can): the watchdog runs */
    atomic_int gate_refused;        /* the driver refused a wait: no pair is gated from then on */
    int pages;                      /* gate pages made, never unmapped (a late write lands in memory of ours) */
    pthread_mutex_t mu;             /* the flusher's reads, a context going, a new pool */
    int relaxed;                    /* the flusher's thread was put in relaxed capture mode */
    struct pool pools[EV_POOLS];
} ev = {.mu = PTHREAD_MUTEX_INITIALIZER};

static struct { _Atomic uint64_t timed, missed, failed, idle, idle_ns, gated, forced, lead, lead_ns; } g_st;
static _Atomic uintptr_t g_seen[EV_SEEN];   /* functions and execs a sampled launch has met */
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

/* The watchdog: opens any gate its thread has left shut GATE_FORCE_NS (see above). Memory only: no driver call, no
 * lock, so nothing a stalled stream holds up can hold it up. Wakes every 10 ms while the census runs. */
static void *watchdog(void *arg)
{
    (void)arg;
    struct timespec nap = {0, 10000000};
    while (atomic_load_explicit(&ev.gate, memory_order_relaxed)) {
        nanosleep(&nap, NULL);
        uint64_t now = gc_mono_ns();
        for (int i = 0; i < EV_POOLS; i++) {
            uint32_t *w = atomic_load_explicit(&ev.pools[i].words, memory_order_acquire);
            for (int k = 0; w && k < EV_PAIRS; k++) {
                struct pair *p = &ev.pools[i].p[k];
                uint32_t seq = atomic_load_explicit(&p->open, memory_order_acquire);
                /* signed: a gate shut after `now` was read is not 2^64 ns old (unsigned, such pairs were forced at
                 * once) */
                int64_t age = (int64_t)(now - atomic_load_explicit(&p->opened_ns, memory_order_relaxed));
                if (!seq || age < (int64_t)GATE_FORCE_NS || !atomic_compare_exchange_strong(&p->open, &seq, 0))
                    continue;
                __atomic_store_n(&w[k], seq, __ATOMIC_RELEASE);   /* its thread finds the gate open: forced */
            }
        }
    }
    return NULL;
}

int gc_events_start(uint32_t every_eager, uint32_t every_graph, int gate)
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
    RESOLVE(wait_value, "cuStreamWaitValue32_v2", "cuStreamWaitValue32");
    RESOLVE(host_register, "cuMemHostRegister_v2", "cuMemHostRegister");
    RESOLVE(host_device_ptr, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer");
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
    if (gate && !(drv.wait_value && drv.host_register && drv.host_device_ptr))
        gc_log("event pairs not gated: the driver lacks stream memory operations (OTEL_GPU_CENSUS_EVENT_GATE); "
               "eager pairs on an idle stream hold their launch call");
    else if (gate) {
        atomic_store(&ev.gate, 1);
        /* it calls no library: a small stack */
        if (gc_thread_start(watchdog, 64 * 1024, "watchdog thread of the event gates, so event pairs are not gated "
                                                 "(OTEL_GPU_CENSUS_EVENT_GATE)") != 0)
            atomic_store(&ev.gate, 0);
    }
    atomic_store(&ev.on, 1);
    return 0;
}

/* Pool `pl`'s gate words: a page of ours (never unmapped: a late write can only land in our memory), registered in
 * the pool's context, which is current on the calling thread (under ev.mu), and mapped for its device. Registered per
 * context, not portable: it goes with its context, as the pool's streams do. In relaxed capture mode: never an
 * unsafe call for a capture elsewhere. Failing: the pool is ungated (one line, once). */
static void gate_pool(struct pool *pl)
{
    static int told;
    CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
    pl->gate = 0;
    atomic_store(&pl->words, NULL);
    if (!atomic_load(&ev.gate) || ev.pages >= GATE_PAGES) goto out;
    void *h = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (h == MAP_FAILED) goto out;
    ev.pages++;
    madvise(h, 4096, MADV_DONTFORK);   /* a fork never makes the page copy-on-write: the GPU's page stays ours */
    CUdeviceptr d = 0;
    if (drv.exchange_mode(&m) != CUDA_SUCCESS) goto out;
    CUresult r = drv.host_register(h, 4096, CU_MEMHOSTREGISTER_DEVICEMAP);
    if (r == CUDA_SUCCESS && drv.host_device_ptr(&d, h, 0) == CUDA_SUCCESS) {
        pl->gate = d;
        atomic_store(&pl->words, (uint32_t *)h);
    }
    drv.exchange_mode(&m);
out:
    if (!pl->gate && atomic_load(&ev.gate) && !told++)
        gc_log("event pairs of a context not gated: its gate words could not be mapped (OTEL_GPU_CENSUS_EVENT_GATE); "
               "its eager pairs on an idle stream hold their launch call");
}

/* First meeting of `key` (a function or a graph exec) by the sample: noted, and 1. Lock-free; a full table: 1. */
static int first_meeting(uintptr_t key)
{
    uint32_t h = (uint32_t)((key >> 4) * 2654435761u);
    for (int k = 0; k < 32; k++) {
        _Atomic uintptr_t *e = &g_seen[(h + k) % EV_SEEN];
        uintptr_t v = atomic_load_explicit(e, memory_order_relaxed);
        if (v == key) return 0;
        if (!v) {
            uintptr_t z = 0;
            if (atomic_compare_exchange_strong(e, &z, key) || z != key) return 1;
            return 0;
        }
    }
    return 1;
}

/* The gate of pair `k` of pool `pl` opened: the stream may pass. 0: the watchdog had opened it already. */
static int gate_open(struct pool *pl, int k)
{
    struct pair *p = &pl->p[k];
    uint32_t seq = p->seq;
    uint32_t *w = atomic_load_explicit(&pl->words, memory_order_acquire);
    if (!atomic_compare_exchange_strong(&p->open, &seq, 0)) return 0;
    if (w) __atomic_store_n(&w[k], p->seq, __ATOMIC_RELEASE);
    return 1;
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
                gate_pool(&ev.pools[i]);
                atomic_store(&ev.pools[i].ctx, c);
                found = i;
            }
        pthread_mutex_unlock(&ev.mu);
    }
    t_ctx = c, t_pool = found, t_gen = gen;
    return found;
}

/* Whether this launch of the calling thread is one of the sample: every launch pays this and nothing more (a graph
 * launch also one look-up of its exec, for the minimum of spans each exec version gets). */
int gc_events_tick(const void *exec)
{
    if (!atomic_load_explicit(&ev.on, memory_order_relaxed)) return 0;
    int graph = exec != NULL;
    if (t_left[graph] > 1) {
        t_left[graph]--;
        return graph && gc_graphs_span_wanted((CUgraphExec)exec, GRAPH_MIN_SPANS);
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

int gc_events_before(CUstream s, CUcontext c, int dev, uintptr_t key, int graph)
{
    /* an event recorded into a capturing stream would be a node of its graph: none while any capture is open */
    if (!c || dev < 0 || gc_launches_any_capture()) return -1;
    int pi = pool_of(c, dev);
    if (pi < 0) { atomic_fetch_add_explicit(&g_st.missed, 1, memory_order_relaxed); return -1; }
    struct pool *pl = &ev.pools[pi];
    int gate = pl->gate && atomic_load_explicit(&ev.gate, memory_order_relaxed) &&
               !atomic_load_explicit(&ev.gate_refused, memory_order_relaxed);
    if (gate && first_meeting(key)) return -1;   /* its first launch may load code and wait for the context */
    uint32_t start = atomic_fetch_add_explicit(&pl->cursor, 1, memory_order_relaxed);
    for (uint32_t k = 0; k < 8; k++) {
        int i = (int)((start + k) % EV_PAIRS);
        struct pair *p = &pl->p[i];
        int free_ = P_FREE;
        if (atomic_load_explicit(&p->state, memory_order_relaxed) != P_FREE ||
            !atomic_compare_exchange_strong_explicit(&p->state, &free_, P_BUSY, memory_order_acquire,
                                                     memory_order_relaxed))
            continue;
        uint32_t gen = atomic_load_explicit(&pl->gen, memory_order_acquire);
        if (p->gen != gen) p->a = p->b = p->lead = NULL;   /* made in a context that went: gone with it */
        p->gen = gen;
        p->gated = p->led = 0;
        if ((!p->a && drv.create(&p->a, CU_EVENT_DEFAULT) != CUDA_SUCCESS) ||
            (!p->b && drv.create(&p->b, CU_EVENT_DEFAULT) != CUDA_SUCCESS)) {
            atomic_fetch_add_explicit(&g_st.failed, 1, memory_order_relaxed);
            atomic_store_explicit(&p->state, P_FREE, memory_order_release);
            return -1;
        }
        if (gate) { /* the stream waits for this use's value; the word holds the last use's (the pair is ours) */
            p->seq = p->seq + 1 ? p->seq + 1 : 1;
            atomic_store_explicit(&p->opened_ns, gc_mono_ns(), memory_order_relaxed);
            atomic_store_explicit(&p->open, p->seq, memory_order_release);
            CUresult r = drv.wait_value(s, pl->gate + (CUdeviceptr)i * sizeof(uint32_t), p->seq,
                                        CU_STREAM_WAIT_VALUE_GEQ);
            if (r == CUDA_SUCCESS) {
                p->gated = 1;
            } else { /* never waited on: this pair goes ungated, and every one after it */
                gate_open(pl, i);
                if (!atomic_exchange(&ev.gate_refused, 1))
                    gc_log("event pairs not gated from now on: the driver refused a stream wait (CUresult %d, "
                           "OTEL_GPU_CENSUS_EVENT_GATE); eager pairs on an idle stream hold their launch call", (int)r);
            }
        }
        /* a gated eager pair reads the kernel plus the GPU's dispatch and its pass over the second event; the event
         * just before `a` measures one such pass, taken off the pair when it is read */
        if (p->gated && !graph && (p->lead || drv.create(&p->lead, CU_EVENT_DEFAULT) == CUDA_SUCCESS))
            p->led = drv.record(p->lead, s) == CUDA_SUCCESS;
        if (drv.record(p->a, s) != CUDA_SUCCESS) {
            if (p->gated) gate_open(pl, i);
            atomic_fetch_add_explicit(&g_st.failed, 1, memory_order_relaxed);
            atomic_store_explicit(&p->state, P_FREE, memory_order_release);
            return -1;
        }
        return pi * EV_PAIRS + i;
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
        if (p->gated) gate_open(pl, slot % EV_PAIRS);
        p->a = p->b = p->lead = NULL;
        atomic_store_explicit(&p->state, P_FREE, memory_order_release);
        return;
    }
    p->idle = 0;
    if (ok && !corr && !p->gated) { /* ungated eager: had the GPU reached the first event before the kernel was submitted? */
        CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;   /* never an unsafe call for a capture elsewhere */
        if (drv.exchange_mode(&m) == CUDA_SUCCESS) {
            p->idle = drv.query(p->a) != CUDA_ERROR_NOT_READY;
            drv.exchange_mode(&m);
        } else {
            p->idle = 1;   /* not known: not the sample */
        }
    }
    int recorded = ok && drv.record(p->b, s) == CUDA_SUCCESS;
    if (p->gated) { /* launch and second event submitted: the GPU may meet them now, back to back */
        atomic_fetch_add_explicit(&g_st.gated, 1, memory_order_relaxed);
        if (!gate_open(pl, slot % EV_PAIRS)) { /* the watchdog opened it: the pair holds the stall */
            atomic_fetch_add_explicit(&g_st.forced, 1, memory_order_relaxed);
            atomic_store_explicit(&p->state, P_FREE, memory_order_release);
            return;
        }
    }
    if (!recorded) {
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
            float lead_ms = 0;
            if (r == CUDA_SUCCESS && drv.elapsed(&ms, p->a, p->b) == CUDA_SUCCESS && ms >= 0 &&
                (!p->led || (drv.elapsed(&lead_ms, p->lead, p->a) == CUDA_SUCCESS && lead_ms >= 0))) {
                uint64_t ns = (uint64_t)((double)ms * 1e6 + 0.5), lead = (uint64_t)((double)lead_ms * 1e6 + 0.5);
                if (p->led) {
                    atomic_fetch_add_explicit(&g_st.lead, 1, memory_order_relaxed);
                    atomic_fetch_add_explicit(&g_st.lead_ns, lead, memory_order_relaxed);
                    ns = ns > lead ? ns - lead : 0;
                }
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
        if (p->gen == made && p->lead) drv.destroy(p->lead);
        p->a = p->b = p->lead = NULL;
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
    atomic_store(&ev.gate, 0);   /* no watchdog in the child; nothing of it is gated */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    ev.mu = fresh; /* the parent's flusher may have held it at fork time; the parent's events are not ours */
}

void gc_events_stats(struct gc_events_stats *out)
{
    out->every_eager = ev.every_eager;
    out->every_graph = ev.every_graph;
    out->gate = (uint32_t)(atomic_load(&ev.gate) && !atomic_load(&ev.gate_refused));
    out->timed = atomic_load(&g_st.timed);
    out->missed = atomic_load(&g_st.missed);
    out->failed = atomic_load(&g_st.failed);
    out->idle = atomic_load(&g_st.idle);
    out->idle_ns = atomic_load(&g_st.idle_ns);
    out->gated = atomic_load(&g_st.gated);
    out->forced = atomic_load(&g_st.forced);
    out->lead = atomic_load(&g_st.lead);
    out->lead_ns = atomic_load(&g_st.lead_ns);
}
