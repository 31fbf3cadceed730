/*
 * launches.c - every eager kernel launch counted on the thread that launches it, by the library preloaded
 * (interpose.c calls gc_launches_count from its launch wrappers; the default collector).
 *
 * What a launch costs here: the device the wrapper already knows, the clock, and two relaxed atomic adds (per
 * device, per 20 ms window slot). No lock, no allocation. The injector folds the counters into the segment under
 * its own lock (gc_launches_fold), from the flusher.
 *
 * A launch into a stream that is being captured (CUDA graph capture) runs nothing: it makes a graph node, counted
 * when the graph is launched. Begin and end of captures are watched, and only while one is open does a launch ask
 * the driver whether its stream captures.
 *
 * Windows: a launch is placed by when it was launched (CLOCK_MONOTONIC mapped onto the census clock). Each window
 * slot's counter only grows; the fold takes the growth since the last fold and gives it to the one window of the
 * ring that maps to the slot near "now" (the flusher folds far inside the ring's 41 s). Reading CLOCK_MONOTONIC is
 * most of what a counted launch costs, so a launch reads CLOCK_MONOTONIC_COARSE (the same clock as of its last tick:
 * never ahead of it) and the precise one only near a window's end, where the two could differ: the slot is the one
 * the precise clock would give (window_now).
 *
 * Steps: the thread's own count is exact between gc_step_begin and gc_step_end (gc_launches_step_push and _pop,
 * called by steps.c, keep the marks); the step's total is deposited at its end in a slot the fold empties.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <cuda.h>

#include "internal.h"

#define COUNT_BITS 26                     /* a step deposit: id << 32 | device << 26 | launches */
#define COUNT_MAX ((1ull << COUNT_BITS) - 1)

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

/* the fold's own view, written under the injector's lock; f_dev and f_lost are also read without it by
 * gc_launches_pending (relaxed atomics: a stale answer only moves a fold to the next wake) */
static _Atomic uint64_t f_dev[GC_MAX_DEVICES], f_lost;
static uint64_t f_win[GC_WINDOW_SLOTS];
static uint64_t f_last_idx;

static __thread int t_dev = -1;           /* the thread's device, as its last launch said */
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

/* The window slot of now (CLOCK_MONOTONIC mapped onto the census clock). The coarse clock reads c <= the precise time
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

int gc_launches_start(int64_t gpu_minus_mono)
{
    if (atomic_load(&g_started)) return 0;
    g_gpu_minus_mono = gpu_minus_mono;
    choose_clock();
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (cuda) *(void **)&g_is_capturing = dlsym(cuda, "cuStreamIsCapturing");
    atomic_store(&g_counting, 1);
    atomic_store(&g_started, 1);
    return 0;
}

void gc_launches_set_counting(int on) { atomic_store(&g_counting, on && atomic_load(&g_started)); }

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

void gc_launches_count(int dev)
{
    if (!atomic_load_explicit(&g_counting, memory_order_relaxed)) return;
    if (dev >= 0) t_dev = dev;   /* the thread's device, for its steps */
    count_on(dev);
}

int gc_launches_counting(void) { return atomic_load_explicit(&g_counting, memory_order_relaxed); }

/* A launch recorded into a graph under capture, not run: asked of the driver only while a capture is
 * open somewhere in the process. */
int gc_launches_capturing(CUstream stream)
{
    if (atomic_load_explicit(&g_capturing, memory_order_relaxed) <= 0 || !g_is_capturing) return 0;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    return g_is_capturing(stream, &st) == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

int gc_launches_any_capture(void) { return atomic_load_explicit(&g_capturing, memory_order_relaxed) > 0; }

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

/* Eager launches per step: the thread's launch count when the innermost step last resumed, and what each step on the
 * stack had before a nested one began. Work is the innermost's. */
static __thread uint64_t t_mark, t_acc[GC_STEP_DEPTH];

static void step_done(uint64_t id, uint64_t n);

void gc_launches_step_push(uint32_t depth)
{
    if (depth) t_acc[depth - 1] += t_launches - t_mark;
    t_mark = t_launches;
    t_acc[depth] = 0;
}

void gc_launches_step_pop(uint32_t depth, uint32_t id)
{
    step_done(id, t_acc[depth - 1] + (t_launches - t_mark));
    t_mark = t_launches;
}

/* A step's launches, deposited at its end for the next fold. A step ended twice before a fold (vLLM's
 * sample_tokens and SGLang's delayed sampling reopen the step they belong to) adds to its deposit; a
 * deposit of another step in the slot (1,024 steps older, or the same step on another device) is lost. */
static void step_done(uint64_t id, uint64_t n)
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
        if (atomic_load_explicit(&g_dev[d], memory_order_relaxed) !=
            atomic_load_explicit(&f_dev[d], memory_order_relaxed))
            return 1;
    /* every placed launch is in a device's count (windows follow it); lost ones and steps are not */
    return atomic_load_explicit(&g_lost, memory_order_relaxed) != atomic_load_explicit(&f_lost, memory_order_relaxed) ||
           atomic_load_explicit(&g_step_new, memory_order_acquire);
}

void gc_launches_fold(gc_tally *t, gc_segment *seg, uint64_t mono_now)
{
    if (!atomic_load(&g_started) || !t || !seg) return;
    for (uint32_t d = 0; d < GC_MAX_DEVICES; d++) {
        uint64_t c = atomic_load_explicit(&g_dev[d], memory_order_relaxed);
        uint64_t f = atomic_load_explicit(&f_dev[d], memory_order_relaxed);
        if (c != f) gc_tally_launches_device(t, d, c - f);
        atomic_store_explicit(&f_dev[d], c, memory_order_relaxed);
    }
    uint64_t lost = atomic_load_explicit(&g_lost, memory_order_relaxed);
    seg->launches_lost += lost - atomic_load_explicit(&f_lost, memory_order_relaxed);
    atomic_store_explicit(&f_lost, lost, memory_order_relaxed);
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
