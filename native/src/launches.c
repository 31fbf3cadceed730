/*
 * launches.c - every eager kernel launch counted on the thread that launches it
 * (OTEL_GPU_CENSUS_KERNELS=counted, the default).
 *
 * CUPTI's kernel record costs the launching thread ~0.9 us per eager launch on an H200
 * (docs/measurements.md §12); llama-server launches 85 of them per output token, which cost it 2-4 %
 * of its throughput (§16). A callback on the launch calls themselves costs a fraction of that, so the
 * count stays exact while kernel records, needed only for durations, are taken on a duty cycle.
 *
 * What a launch costs here: a thread-local lookup of its context's device, the monotonic clock, and
 * two relaxed atomic adds (per device, per 20 ms window slot). No lock, no allocation, no call into
 * CUPTI except the first time a thread sees a context. The injector folds the counters into the
 * segment under its own lock (gc_launches_fold), from the flusher and whenever a buffer completes.
 *
 * A runtime launch (cudaLaunchKernel) runs a driver launch inside it; both callbacks are enabled, so
 * that a launch is seen whether or not the driver reports the inner call, and the inner one is not
 * counted again. Only launches that returned success count.
 *
 * Windows: a launch is placed by when it was launched (CLOCK_MONOTONIC mapped onto CUPTI's clock),
 * kernel records by when they started on the GPU. Each window slot's counter only grows; the fold
 * takes the growth since the last fold and gives it to the one window of the ring that maps to the
 * slot near "now" (the flusher folds at least every period, far inside the ring's 41 s).
 *
 * Steps: the thread's own count is exact between gc_step_begin and gc_step_end (steps.c keeps the
 * marks); the step's total is deposited at its end in a slot the fold empties.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <cuda.h>

#include "cupti_api.h"
#include "internal.h"

#define IDS ((int)CUPTI_DRIVER_TRACE_CBID_SIZE > (int)CUPTI_RUNTIME_TRACE_CBID_SIZE \
             ? (int)CUPTI_DRIVER_TRACE_CBID_SIZE : (int)CUPTI_RUNTIME_TRACE_CBID_SIZE)
#define COUNT_BITS 26                     /* a step deposit: id << 32 | device << 26 | launches */
#define COUNT_MAX ((1ull << COUNT_BITS) - 1)

static uint8_t g_launch[2][IDS];          /* [driver?][cbid]: a kernel launch call */
static atomic_int g_started, g_counting;
static int64_t g_gpu_minus_mono;          /* CUPTI clock - CLOCK_MONOTONIC */

/* written by the launching threads */
static _Atomic uint64_t g_dev[GC_MAX_DEVICES];
static _Atomic uint64_t g_win[GC_WINDOW_SLOTS];
static _Atomic uint64_t g_step[GC_STEP_SLOTS];
static _Atomic uint64_t g_lost;

/* the fold's own view (under the injector's lock) */
static uint64_t f_dev[GC_MAX_DEVICES], f_win[GC_WINDOW_SLOTS], f_lost;
static uint64_t f_last_idx;

static __thread uint32_t t_ctx_uid;       /* the context last seen (its CUPTI uid; 0: none) ... */
static __thread int t_dev = -1;           /* ... and its device */
static __thread uint32_t t_in_runtime;    /* inside a runtime launch: its driver launch is not another */
static __thread uint64_t t_launches;

static int is_launch(CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const char *name)
{
    static const char *const runtime[] = {"cudaLaunch", "cudaLaunch_ptsz", "cudaLaunchKernel", "cudaLaunchKernel_ptsz",
        "cudaLaunchKernelExC", "cudaLaunchKernelExC_ptsz", "cudaLaunchCooperativeKernel",
        "cudaLaunchCooperativeKernel_ptsz"};
    static const char *const driver[] = {"cuLaunch", "cuLaunchGrid", "cuLaunchGridAsync", "cuLaunchKernel",
        "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz", "cuLaunchCooperativeKernel",
        "cuLaunchCooperativeKernel_ptsz"};
    int drv = dom == CUPTI_CB_DOMAIN_DRIVER_API;
    const char *const *p = drv ? driver : runtime;
    size_t n = drv ? sizeof(driver) / sizeof(*driver) : sizeof(runtime) / sizeof(*runtime);
    for (size_t i = 0; i < n; i++)
        if (strcmp(name, p[i]) == 0) {
            if (cbid < (CUpti_CallbackId)IDS) g_launch[drv][cbid] = 1;
            return 1;
        }
    return 0;
}

int gc_launches_start(int64_t gpu_minus_mono)
{
    if (atomic_load(&g_started)) return 0;
    g_gpu_minus_mono = gpu_minus_mono;
    /* every runtime and driver kernel launch call, or none: a partial set would not be exact */
    int n = gc_cupti_enable_api("launches not counted", is_launch);
    if (n <= 0) return -1;
    atomic_store(&g_counting, 1);
    atomic_store(&g_started, 1);
    return 0;
}

void gc_launches_set_counting(int on) { atomic_store(&g_counting, on && atomic_load(&g_started)); }

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void count(const CUpti_CallbackData *cb)
{
    t_launches++;
    if (!cb->context) {
        atomic_fetch_add_explicit(&g_lost, 1, memory_order_relaxed);
        return;
    }
    if (cb->contextUid != t_ctx_uid || t_dev < 0) {
        uint32_t dev = 0;
        t_dev = gc_cupti_device_of(cb->context, &dev) == CUPTI_SUCCESS && dev < GC_MAX_DEVICES ? (int)dev : -1;
        t_ctx_uid = cb->contextUid;
    }
    if (t_dev < 0) { /* lost launches are in no total, windows included */
        atomic_fetch_add_explicit(&g_lost, 1, memory_order_relaxed);
        return;
    }
    atomic_fetch_add_explicit(&g_dev[t_dev], 1, memory_order_relaxed);
    uint64_t gpu = (uint64_t)((int64_t)mono_ns() + g_gpu_minus_mono);
    atomic_fetch_add_explicit(&g_win[(gpu / GC_WINDOW_NS) & (GC_WINDOW_SLOTS - 1)], 1, memory_order_relaxed);
}

void gc_launches_callback(CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const void *data)
{
    int drv = dom == CUPTI_CB_DOMAIN_DRIVER_API;
    if ((!drv && dom != CUPTI_CB_DOMAIN_RUNTIME_API) || cbid >= (CUpti_CallbackId)IDS || !g_launch[drv][cbid])
        return;
    const CUpti_CallbackData *cb = data;
    int enter = cb->callbackSite == CUPTI_API_ENTER;
    if (!drv) { /* the runtime's launch: counted at its exit, and its driver launch is not */
        if (enter) {
            t_in_runtime++;
            return;
        }
        if (t_in_runtime) t_in_runtime--;
        if (atomic_load_explicit(&g_counting, memory_order_relaxed) && cb->functionReturnValue &&
            *(const int *)cb->functionReturnValue == 0 /* cudaSuccess */)
            count(cb);
        return;
    }
    if (enter || t_in_runtime || !atomic_load_explicit(&g_counting, memory_order_relaxed)) return;
    if (cb->functionReturnValue && *(const CUresult *)cb->functionReturnValue == CUDA_SUCCESS) count(cb);
}

uint64_t gc_launches_thread(void) { return t_launches; }

void gc_launches_step_done(uint64_t id, uint64_t n)
{
    if (!n || !atomic_load_explicit(&g_started, memory_order_relaxed)) return;
    if (n > COUNT_MAX) {
        atomic_fetch_add_explicit(&g_lost, n - COUNT_MAX, memory_order_relaxed);
        n = COUNT_MAX;
    }
    uint64_t dev = t_dev < 0 ? 0 : (uint64_t)t_dev;
    uint64_t v = (id << 32) | (dev << COUNT_BITS) | n;
    uint64_t old = atomic_exchange_explicit(&g_step[id & (GC_STEP_SLOTS - 1)], v, memory_order_acq_rel);
    if (old) /* a step 1024 steps older that no fold took yet */
        atomic_fetch_add_explicit(&g_lost, old & COUNT_MAX, memory_order_relaxed);
}

int gc_launches_pending(void)
{
    if (!atomic_load(&g_started)) return 0;
    for (uint32_t d = 0; d < GC_MAX_DEVICES; d++)
        if (atomic_load_explicit(&g_dev[d], memory_order_relaxed) != f_dev[d]) return 1;
    return 0;
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
    for (uint32_t s = 0; s < GC_STEP_SLOTS; s++) {
        if (!atomic_load_explicit(&g_step[s], memory_order_relaxed)) continue;
        uint64_t v = atomic_exchange_explicit(&g_step[s], 0, memory_order_acq_rel);
        if (v) gc_tally_launches_step(t, v >> 32, (uint32_t)((v >> COUNT_BITS) & 63), v & COUNT_MAX);
    }
}
