/*
 * launches.c - every eager kernel launch counted on the thread that launches it
 * (OTEL_GPU_CENSUS_KERNELS=counted, the default).
 *
 * CUPTI's kernel record costs the launching thread about a microsecond per eager launch
 * (docs/measurements.md: micro_eager_us_per_launch_precise); llama-server launches dozens of them per output
 * token, a few per cent of its throughput. A callback on the launch calls themselves costs a fraction of that, so the
 * count stays exact while kernel records, needed only for durations, are taken on a duty cycle.
 *
 * What a launch costs here: a thread-local lookup of its context's device, the monotonic clock, and
 * two relaxed atomic adds (per device, per 20 ms window slot). No lock, no allocation, no call into
 * CUPTI except the first time a thread sees a context. The injector folds the counters into the
 * segment under its own lock (gc_launches_fold), from the flusher and whenever a buffer completes.
 *
 * A runtime launch (cudaLaunchKernel) runs a driver launch inside it, and CUPTI reports both: the
 * driver's is counted, and the runtime's exit counts only a launch with no driver launch reported
 * inside it (a runtime or CUPTI that does not report the inner call). Each callback costs the
 * launching thread a little: a runtime launch call whose
 * last 256 successful launches all had their driver launch reported is proven redundant and switched
 * off by the flusher (gc_launches_tune), as is every launch callback while nothing is counted (a paused
 * census, a finished one); steps keep theirs (cupti_api.c counts who wants each). Only launches that
 * returned success count.
 *
 * A launch into a stream that is being captured (CUDA graph capture) runs nothing: it makes a graph
 * node, counted when the graph is launched. Begin and end of captures are watched, and only while one
 * is open does a launch ask the driver whether its stream captures.
 *
 * Windows: a launch is placed by when it was launched (CLOCK_MONOTONIC mapped onto CUPTI's clock),
 * kernel records by when they started on the GPU. Each window slot's counter only grows; the fold
 * takes the growth since the last fold and gives it to the one window of the ring that maps to the
 * slot near "now" (the flusher folds at least every period, far inside the ring's 41 s).
 * Reading CLOCK_MONOTONIC was ~70 % of what a wrapped eager launch cost the census on a CPU (~25 of ~35 ns on
 * a KVM guest, bench/floor/eager_path.py), so a launch reads CLOCK_MONOTONIC_COARSE (the same clock as of its
 * last tick: never ahead of it, ~5 ns) and the precise one only near a window's end, where the two could
 * differ: the slot is the one the precise clock would give (window_now; eager_path.py --placement checks it).
 *
 * Steps: the thread's own count is exact between gc_step_begin and gc_step_end (steps.c keeps the
 * marks); the step's total is deposited at its end in a slot the fold empties.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "cupti_api.h"
#include "internal.h"

#define COUNT_BITS 26                     /* a step deposit: id << 32 | device << 26 | launches */
#define COUNT_MAX ((1ull << COUNT_BITS) - 1)

/* [driver?][cbid]: a kernel launch call, and where its stream is; or a capture's begin or end */
enum { NOT = 0, RT, RT_EX, DRV, DRV_EX, DRV_GRID, NO_STREAM, BEGIN_CAPTURE, END_CAPTURE };
static uint8_t g_role[2][GC_API_CBIDS];
static atomic_int g_started, g_counting;
static atomic_int g_capturing;            /* captures open (begun and not ended), any stream */
static CUresult (*g_is_capturing)(CUstream, CUstreamCaptureStatus *);
static int64_t g_gpu_minus_mono;          /* CUPTI clock - CLOCK_MONOTONIC */

/* written by the launching threads */
static _Atomic uint64_t g_dev[GC_MAX_DEVICES];
static _Atomic uint64_t g_win[GC_WINDOW_SLOTS];
static _Atomic uint64_t g_step[GC_STEP_SLOTS];
static _Atomic uint64_t g_lost;
static atomic_int g_step_new;             /* a step deposited its count since the last fold */

/* the fold's own view (under the injector's lock) */
static uint64_t f_dev[GC_MAX_DEVICES], f_win[GC_WINDOW_SLOTS], f_lost;
static uint64_t f_last_idx;

static __thread uint32_t t_ctx_uid;       /* the context last seen (its CUPTI uid; 0: none) ... */
static __thread int t_dev = -1;           /* ... and its device */
static __thread uint32_t t_rt;            /* inside a runtime launch: its index in g_ids + 1; 0: not */
static __thread uint32_t t_nested;        /* ... and a driver launch was reported inside it */
static __thread uint64_t t_launches;

/* The coarse clock's lag behind CLOCK_MONOTONIC is at most `g_coarse_lag` ns (two of its ticks: ticks run late by
 * a fraction of one, up to 1.26 ticks seen on a KVM guest), or 0: the precise clock every launch. */
static _Atomic uint64_t g_coarse_lag;

static int coarse_ns(uint64_t *ns)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) != 0) return -1;
    *ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    return 0;
}

/* The coarse clock stands in where it pays: a launch then costs a coarse read, and a precise one too in the last
 * g_coarse_lag of each window. Not where its ticks are 5 ms or longer (HZ=100), nor where it is no cheaper (a system
 * call where the vDSO lacks it). Timed once, at start, on the starting thread; the best of three trials each. */
static void choose_clock(void)
{
    struct timespec res;
    if (clock_getres(CLOCK_MONOTONIC_COARSE, &res) != 0 || res.tv_sec != 0 || res.tv_nsec <= 0 ||
        (uint64_t)res.tv_nsec >= GC_WINDOW_NS / 4)
        return;
    const uint64_t lag = 2 * (uint64_t)res.tv_nsec, reads = 32;
    uint64_t coarse = UINT64_MAX, precise = UINT64_MAX, sink = 0;
    for (int k = 0; k < 3; k++) {
        uint64_t t0 = gc_mono_ns(), c = 0;
        for (uint64_t i = 0; i < reads; i++) {
            if (coarse_ns(&c) != 0) return;
            sink += c;
        }
        uint64_t t1 = gc_mono_ns();
        for (uint64_t i = 0; i < reads; i++) sink += gc_mono_ns();
        uint64_t t2 = gc_mono_ns();
        if (t1 - t0 < coarse) coarse = t1 - t0;
        if (t2 - t1 < precise) precise = t2 - t1;
    }
    (void)sink;
    /* coarse + precise * lag / window < precise (in us: no overflow) */
    if (coarse * (GC_WINDOW_NS / 1000) < precise * ((GC_WINDOW_NS - lag) / 1000))
        atomic_store_explicit(&g_coarse_lag, lag, memory_order_relaxed);
}

/* The window slot of now (CLOCK_MONOTONIC mapped onto CUPTI's clock). The coarse clock reads c <= the precise time
 * t <= c + lag: when c and c + lag fall in one window, so does t, and no precise read is needed. A tick later than
 * the lag bound places a launch early by at most its lateness, as a thread preempted between its clock read and its
 * count is placed today; never lost (g_dev holds it; the fold reads one window back from its last). */
static uint64_t window_now(void)
{
    uint64_t lag = atomic_load_explicit(&g_coarse_lag, memory_order_relaxed), c;
    if (lag && coarse_ns(&c) == 0) {
        uint64_t gpu = (uint64_t)((int64_t)c + g_gpu_minus_mono);
        if (gpu / GC_WINDOW_NS == (gpu + lag) / GC_WINDOW_NS) return gpu / GC_WINDOW_NS;
    }
    return (uint64_t)((int64_t)gc_mono_ns() + g_gpu_minus_mono) / GC_WINDOW_NS;
}

static int role_of(CUpti_CallbackDomain dom, const char *name)
{
    static const struct { const char *name; uint8_t role; } runtime[] = {
        {"cudaLaunch", NO_STREAM}, {"cudaLaunch_ptsz", NO_STREAM}, {"cudaLaunchKernel", RT},
        {"cudaLaunchKernel_ptsz", RT}, {"cudaLaunchKernelExC", RT_EX}, {"cudaLaunchKernelExC_ptsz", RT_EX},
        {"cudaLaunchCooperativeKernel", RT}, {"cudaLaunchCooperativeKernel_ptsz", RT}},
      driver[] = {
        {"cuLaunch", NO_STREAM}, {"cuLaunchGrid", NO_STREAM}, {"cuLaunchGridAsync", DRV_GRID},
        {"cuLaunchKernel", DRV}, {"cuLaunchKernel_ptsz", DRV}, {"cuLaunchKernelEx", DRV_EX},
        {"cuLaunchKernelEx_ptsz", DRV_EX}, {"cuLaunchCooperativeKernel", DRV}, {"cuLaunchCooperativeKernel_ptsz", DRV}};
    int drv = dom == CUPTI_CB_DOMAIN_DRIVER_API;
    size_t n = drv ? sizeof(driver) / sizeof(*driver) : sizeof(runtime) / sizeof(*runtime);
    for (size_t i = 0; i < n; i++)
        if (strcmp(name, drv ? driver[i].name : runtime[i].name) == 0) return drv ? driver[i].role : runtime[i].role;
    if (strncmp(name, drv ? "cuStreamBeginCapture" : "cudaStreamBeginCapture", drv ? 20 : 22) == 0) return BEGIN_CAPTURE;
    if (strncmp(name, drv ? "cuStreamEndCapture" : "cudaStreamEndCapture", drv ? 18 : 20) == 0) return END_CAPTURE;
    return NOT;
}

/* The launch calls' callbacks (not the captures'), which gc_launches_tune switches. */
#define MAX_IDS 48
#define PROVEN 256                        /* a runtime call's launches, all reported by the driver too */
static struct {
    CUpti_CallbackDomain dom;
    CUpti_CallbackId cbid;
    int on, redundant;
    uint32_t alone_seen, nested_from;     /* the tune's: runtime launches alone so far; nested since then */
} g_ids[MAX_IDS];
static int g_nids;
static uint8_t g_index[2][GC_API_CBIDS];           /* [driver?][cbid]: index in g_ids + 1 */
static _Atomic uint32_t g_rt_nested[MAX_IDS], g_rt_alone[MAX_IDS];
static pthread_mutex_t g_tune_mu = PTHREAD_MUTEX_INITIALIZER;

static int is_launch(CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const char *name)
{
    int role = role_of(dom, name), drv = dom == CUPTI_CB_DOMAIN_DRIVER_API;
    if (!role || cbid >= (CUpti_CallbackId)GC_API_CBIDS) return 0;
    if (role < BEGIN_CAPTURE) {
        if (g_nids >= MAX_IDS) return 0;  /* CUPTI 13.5 has 17; never a role without its slot */
        g_ids[g_nids].dom = dom;
        g_ids[g_nids].cbid = cbid;
        g_ids[g_nids].on = 1;
        g_index[drv][cbid] = (uint8_t)++g_nids;
    }
    g_role[drv][cbid] = (uint8_t)role;
    return 1;
}

int gc_launches_start(int64_t gpu_minus_mono, int by_cupti)
{
    if (atomic_load(&g_started)) return 0;
    g_gpu_minus_mono = gpu_minus_mono;
    choose_clock();
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (cuda) *(void **)&g_is_capturing = dlsym(cuda, "cuStreamIsCapturing");
    if (!by_cupti) { /* the preloaded interposer counts (interpose.c) */
        atomic_store(&g_counting, 1);
        atomic_store(&g_started, 1);
        return 0;
    }
    /* every runtime and driver kernel launch call, or none: a partial set would not be exact */
    g_nids = 0;
    int n = gc_cupti_enable_api("launches not counted", GC_CB_LAUNCHES, is_launch);
    if (n <= 0) return -1;
    atomic_store(&g_counting, 1);
    atomic_store(&g_started, 1);
    return 0;
}

void gc_launches_set_counting(int on) { atomic_store(&g_counting, on && atomic_load(&g_started)); }

int gc_launches_device(const CUpti_CallbackData *cb)
{
    if (!cb->context) return -1;
    if (cb->contextUid != t_ctx_uid || t_dev < 0) {
        uint32_t dev = 0;
        t_dev = gc_cupti_device_of(cb->context, &dev) == CUPTI_SUCCESS && dev < GC_MAX_DEVICES ? (int)dev : -1;
        t_ctx_uid = cb->contextUid;
        gc_contexts_add(cb->context); /* its kernel records are switched per context (contexts.c) */
    }
    return t_dev;
}

/* One launch on device `dev` (-1: unknown, lost: in no total, windows included). */
static void count_on(int dev)
{
    t_launches++;
    if (dev < 0 || dev >= (int)GC_MAX_DEVICES) {
        atomic_fetch_add_explicit(&g_lost, 1, memory_order_relaxed);
        return;
    }
    atomic_fetch_add_explicit(&g_dev[dev], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&g_win[window_now() & (GC_WINDOW_SLOTS - 1)], 1, memory_order_relaxed);
}

static void count(const CUpti_CallbackData *cb) { count_on(gc_launches_device(cb)); }

void gc_launches_count(int dev)
{
    if (!atomic_load_explicit(&g_counting, memory_order_relaxed)) return;
    if (dev >= 0) t_dev = dev;   /* the thread's device, for its steps */
    count_on(dev);
}

int gc_launches_counting(void) { return atomic_load_explicit(&g_counting, memory_order_relaxed); }

/* The launch calls' parameters as CUPTI passes them (generated_cuda_meta.h and
 * generated_cuda_runtime_api_meta.h of its headers, which do not compile on their own): the stream is
 * all we read. cudaLaunchCooperativeKernel and the _ptsz variants share these layouts. */
struct rt_launch { const void *func; dim3 grid, block; void **args; size_t shared; cudaStream_t stream; };
struct rt_launch_ex { const cudaLaunchConfig_t *config; const void *func; void **args; };
struct drv_launch { CUfunction f; unsigned int grid[3], block[3], shared; CUstream stream; void **params, **extra; };
struct drv_launch_ex { const CUlaunchConfig *config; CUfunction f; void **params, **extra; };
struct drv_grid_async { CUfunction f; int width, height; CUstream stream; };

static CUstream stream_of(int role, const void *p)
{
    switch (role) {
    case RT: return (CUstream)((const struct rt_launch *)p)->stream;
    case RT_EX: {
        const cudaLaunchConfig_t *c = ((const struct rt_launch_ex *)p)->config;
        return c ? (CUstream)c->stream : NULL;
    }
    case DRV: return ((const struct drv_launch *)p)->stream;
    case DRV_EX: {
        const CUlaunchConfig *c = ((const struct drv_launch_ex *)p)->config;
        return c ? c->hStream : NULL;
    }
    case DRV_GRID: return ((const struct drv_grid_async *)p)->stream;
    default: return NULL;   /* the legacy calls launch on the default stream */
    }
}

/* A launch recorded into a graph under capture, not run: asked of the driver only while a capture is
 * open somewhere in the process. */
int gc_launches_capturing(CUstream stream)
{
    if (atomic_load_explicit(&g_capturing, memory_order_relaxed) <= 0 || !g_is_capturing) return 0;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    return g_is_capturing(stream, &st) == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

int gc_launches_any_capture(void) { return atomic_load_explicit(&g_capturing, memory_order_relaxed) > 0; }

static int captured(int role, const CUpti_CallbackData *cb)
{
    return cb->functionParams && gc_launches_capturing(stream_of(role, cb->functionParams));
}

void gc_launches_capture(int begin, int ok)
{
    if (begin) {
        if (ok) atomic_fetch_add(&g_capturing, 1);
        return;
    }
    /* an end whose begin came before the census: never below zero */
    int v = atomic_load(&g_capturing);
    while (v > 0 && !atomic_compare_exchange_weak(&g_capturing, &v, v - 1)) {}
}

static void capture_seen(int role, const CUpti_CallbackData *cb)
{
    gc_launches_capture(role == BEGIN_CAPTURE, cb->functionReturnValue && *(const int *)cb->functionReturnValue == 0);
}

void gc_launches_callback(CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const void *data)
{
    int drv = dom == CUPTI_CB_DOMAIN_DRIVER_API;
    if ((!drv && dom != CUPTI_CB_DOMAIN_RUNTIME_API) || cbid >= (CUpti_CallbackId)GC_API_CBIDS) return;
    int role = g_role[drv][cbid];
    if (!role) return;
    const CUpti_CallbackData *cb = data;
    int enter = cb->callbackSite == CUPTI_API_ENTER;
    if (role >= BEGIN_CAPTURE) { /* a runtime capture call and its driver call both count: +2 / -2 */
        if (!enter) capture_seen(role, cb);
        return;
    }
    int ok = cb->functionReturnValue && *(const int *)cb->functionReturnValue == 0; /* cudaSuccess, CUDA_SUCCESS */
    if (!drv) { /* the runtime's launch: counted at its exit only when no driver launch was reported in it */
        uint32_t me = g_index[0][cbid];
        if (enter) {
            t_rt = me;
            t_nested = 0;
            return;
        }
        int mine = me && t_rt == me; /* its enter seen (not: the callback was switched on mid-call) */
        t_rt = 0;
        if (!mine || !ok) return;
        if (t_nested) {
            atomic_fetch_add_explicit(&g_rt_nested[me - 1], 1, memory_order_relaxed);
            return;
        }
        if (captured(role, cb)) return;
        atomic_fetch_add_explicit(&g_rt_alone[me - 1], 1, memory_order_relaxed);
        if (atomic_load_explicit(&g_counting, memory_order_relaxed)) count(cb);
        return;
    }
    if (enter || !ok) return;
    if (t_rt) t_nested = 1;   /* a stale t_rt (its exit switched off) only marks launches counted anyway */
    if (atomic_load_explicit(&g_counting, memory_order_relaxed) && !captured(role, cb)) count(cb);
}

/* A runtime launch call is redundant once PROVEN launches in a row had their driver launch reported
 * (the count restarts at every wake that saw one alone: a launch between the two callbacks being
 * switched on is one, a runtime whose driver calls go unreported is every one). Switched on drivers
 * first and off runtimes first, so that no launch sees its runtime callback without its driver's. */
void gc_launches_tune(void)
{
    if (!atomic_load(&g_started)) return;
    int want = atomic_load(&g_counting);
    pthread_mutex_lock(&g_tune_mu);
    for (int pass = 0; pass < 2; pass++) {
        CUpti_CallbackDomain dom = (pass == 0) == !!want ? CUPTI_CB_DOMAIN_DRIVER_API : CUPTI_CB_DOMAIN_RUNTIME_API;
        for (int i = 0; i < g_nids; i++) {
            if (g_ids[i].dom != dom) continue;
            if (dom == CUPTI_CB_DOMAIN_RUNTIME_API && !g_ids[i].redundant) {
                uint32_t alone = atomic_load_explicit(&g_rt_alone[i], memory_order_relaxed);
                uint32_t nested = atomic_load_explicit(&g_rt_nested[i], memory_order_relaxed);
                if (alone != g_ids[i].alone_seen) {
                    g_ids[i].alone_seen = alone;
                    g_ids[i].nested_from = nested;
                } else if (nested - g_ids[i].nested_from >= PROVEN) {
                    g_ids[i].redundant = 1;   /* for good: switched off, it can show nothing more */
                }
            }
            int on = want && !g_ids[i].redundant;
            if (on != g_ids[i].on && gc_cupti_api_callback(GC_CB_LAUNCHES, dom, g_ids[i].cbid, on) == 0)
                g_ids[i].on = on;
        }
    }
    pthread_mutex_unlock(&g_tune_mu);
}

uint64_t gc_launches_thread(void) { return t_launches; }

/* A step's launches, deposited at its end for the next fold. A step ended twice before a fold (vLLM's
 * sample_tokens and SGLang's delayed sampling reopen the step they belong to) adds to its deposit; a
 * deposit of another step in the slot (1,024 steps older, or the same step on another device) is lost. */
void gc_launches_step_done(uint64_t id, uint64_t n)
{
    if (!n || !atomic_load_explicit(&g_started, memory_order_relaxed)) return;
    uint64_t dev = t_dev < 0 ? 0 : (uint64_t)t_dev;
    _Atomic uint64_t *slot = &g_step[id & (GC_STEP_SLOTS - 1)];
    const uint64_t key = (id << 32) | (dev << COUNT_BITS);
    uint64_t old = atomic_load_explicit(slot, memory_order_acquire), total, v;
    for (;;) {
        int same = old && (old & ~COUNT_MAX) == key;
        total = n + (same ? old & COUNT_MAX : 0);
        v = key | (total > COUNT_MAX ? COUNT_MAX : total);
        if (atomic_compare_exchange_weak_explicit(slot, &old, v, memory_order_acq_rel, memory_order_acquire)) {
            if (old && !same)
                atomic_fetch_add_explicit(&g_lost, old & COUNT_MAX, memory_order_relaxed);
            break;
        }
    }
    if (total > COUNT_MAX)
        atomic_fetch_add_explicit(&g_lost, total - COUNT_MAX, memory_order_relaxed);
    atomic_store_explicit(&g_step_new, 1, memory_order_release);
}

int gc_launches_pending(void)
{
    if (!atomic_load(&g_started)) return 0;
    for (uint32_t d = 0; d < GC_MAX_DEVICES; d++)
        if (atomic_load_explicit(&g_dev[d], memory_order_relaxed) != f_dev[d]) return 1;
    /* every placed launch is in a device's count (windows follow it); lost ones and steps are not */
    return atomic_load_explicit(&g_lost, memory_order_relaxed) != f_lost ||
           atomic_load_explicit(&g_step_new, memory_order_acquire);
}

void gc_launches_fold(gc_tally *t, gc_segment *seg, uint64_t mono_now)
{
    if (!atomic_load(&g_started) || !t || !seg) return;
    for (uint32_t d = 0; d < GC_MAX_DEVICES; d++) {
        uint64_t c = atomic_load_explicit(&g_dev[d], memory_order_relaxed);
        if (c != f_dev[d]) gc_tally_launches_device(t, d, c - f_dev[d]);
        f_dev[d] = c;
    }
    uint64_t lost = atomic_load_explicit(&g_lost, memory_order_relaxed);
    seg->launches_lost += lost - f_lost;
    f_lost = lost;
    /* Windows from one before the last fold's to one after now (a launch that read the clock just
     * before this fold and counted just after it), at most the ring. */
    uint64_t now_idx = (uint64_t)((int64_t)mono_now + g_gpu_minus_mono) / GC_WINDOW_NS;
    uint64_t hi = now_idx + 1, lo = f_last_idx ? f_last_idx - 1 : 0;
    if (hi - lo >= GC_WINDOW_SLOTS || lo > hi) lo = hi - (GC_WINDOW_SLOTS - 1);
    for (uint64_t idx = lo; idx <= hi; idx++) {
        uint32_t s = (uint32_t)(idx & (GC_WINDOW_SLOTS - 1));
        uint64_t c = atomic_load_explicit(&g_win[s], memory_order_relaxed);
        if (c != f_win[s]) gc_tally_launches_window(t, idx * GC_WINDOW_NS, c - f_win[s]);
        f_win[s] = c;
    }
    f_last_idx = now_idx;
    atomic_store_explicit(&g_step_new, 0, memory_order_relaxed);   /* before the slots: none is missed */
    for (uint32_t s = 0; s < GC_STEP_SLOTS; s++) {
        if (!atomic_load_explicit(&g_step[s], memory_order_relaxed)) continue;
        uint64_t v = atomic_exchange_explicit(&g_step[s], 0, memory_order_acq_rel);
        if (v) gc_tally_launches_step(t, v >> 32, (uint32_t)((v >> COUNT_BITS) & 63), v & COUNT_MAX);
    }
}
