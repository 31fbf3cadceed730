/*
 * steps.c - which step launched each piece of GPU work.
 *
 * gc_step_begin(id) pushes id on the calling thread's own stack. A CUPTI callback at the entry of every
 * API call that launches work (kernels, graph launches, copies, memsets) notes "correlation id -> the
 * thread's innermost step" in a lock-free table; the tally looks each record's correlation id up there.
 *
 * Why not CUPTI's external correlation (cuptiActivityPushExternalCorrelationId and the
 * EXTERNAL_CORRELATION kind)? CUPTI emits those records together with driver/runtime API records, so
 * without tracing every API call (a record per call) it emits none: measured, 0 of them for 132 kernels
 * and copies. A callback on the few launching calls costs far less and needs no records.
 *
 * The table is direct-mapped by correlation id (CUPTI numbers calls in increasing order), one 64-bit
 * word per slot: (correlation id << 32) | step id, so a reader never sees half an entry. A slot is
 * reused after GC_LAUNCH_SLOTS launches; a record that arrives later than that finds another id there
 * and counts as unmatched, never as another step's. Allocated at the first step: 8 MiB, only in
 * processes that use steps.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cupti_api.h"
#include "internal.h"

#define GC_LAUNCH_SLOTS (1u << 20)     /* power of two: ~26 s of launches at 40,000 a second */
#define GC_STEP_DEPTH 8

static _Atomic(_Atomic uint64_t *) g_map;
static __thread uint32_t t_stack[GC_STEP_DEPTH];
static __thread uint32_t t_depth;
static __thread uint32_t t_top;        /* t_stack[t_depth - 1], or 0: what the callback reads */
/* Eager launches per step (the default collector): the thread's launch count when the innermost step last
 * resumed, and what each step on the stack had before a nested one began. Work is the innermost's. */
static __thread uint64_t t_mark, t_acc[GC_STEP_DEPTH];

/* The API calls that put work on the GPU, by name prefix. Graph-node setters (cudaGraphAddMemcpyNode…)
 * do not match: they launch nothing. */
static int launches_work(CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const char *name)
{
    (void)cbid;
    static const char *const runtime[] = {"cudaLaunch", "cudaGraphLaunch", "cudaMemcpy", "cudaMemset"};
    static const char *const driver[] = {"cuLaunch", "cuGraphLaunch", "cuMemcpy", "cuMemset"};
    const char *const *p = dom == CUPTI_CB_DOMAIN_RUNTIME_API ? runtime : driver;
    for (int i = 0; i < 4; i++)
        if (strncmp(name, p[i], strlen(p[i])) == 0) return 1;
    return 0;
}

void gc_steps_note(uint32_t corr)
{
    uint32_t id = t_top;
    if (!id) return;
    _Atomic uint64_t *map = atomic_load_explicit(&g_map, memory_order_relaxed);
    if (map) atomic_store_explicit(&map[corr & (GC_LAUNCH_SLOTS - 1)], ((uint64_t)corr << 32) | id, memory_order_release);
}

void gc_steps_callback(CUpti_CallbackDomain dom, const void *data)
{
    if (dom == CUPTI_CB_DOMAIN_RESOURCE || !t_top) return;   /* most calls of a server outside steps end here */
    const CUpti_CallbackData *cb = data;
    if (cb->callbackSite == CUPTI_API_ENTER) gc_steps_note(cb->correlationId);
}

int gc_steps_start(void)
{
    static atomic_int state;  /* 0 untried, 1 on, -1 off */
    int s = atomic_load(&state);
    if (s) return s > 0 ? 0 : -1;
    static atomic_flag busy = ATOMIC_FLAG_INIT;
    while (atomic_flag_test_and_set(&busy)) {}
    if ((s = atomic_load(&state)) == 0) {
        _Atomic uint64_t *map = calloc(GC_LAUNCH_SLOTS, sizeof(*map));
        if (!map) {
            gc_log("steps off: no memory for the launch table");
        } else {
            atomic_store(&g_map, map);
            /* counting through the preloaded interposer: it notes each call's step (gc_steps_note) */
            if (gc_interpose_on() || gc_cupti_enable_api("steps off", GC_CB_STEPS, launches_work) > 0) s = 1;
        }
        if (s != 1) s = -1;
        atomic_store(&state, s);
    }
    atomic_flag_clear(&busy);
    return s > 0 ? 0 : -1;
}

int gc_steps_push(uint64_t id)
{
    if (id == 0 || id > UINT32_MAX || t_depth >= GC_STEP_DEPTH) return -1;
    uint64_t now = gc_launches_thread();
    if (t_depth) t_acc[t_depth - 1] += now - t_mark;
    t_mark = now;
    t_acc[t_depth] = 0;
    t_stack[t_depth++] = (uint32_t)id;
    t_top = (uint32_t)id;
    return 0;
}

int gc_steps_pop(uint64_t *id)
{
    if (t_depth == 0) return -1;
    uint64_t now = gc_launches_thread();
    gc_launches_step_done(t_stack[t_depth - 1], t_acc[t_depth - 1] + (now - t_mark));
    t_mark = now;
    uint32_t last = t_stack[--t_depth];
    t_top = t_depth ? t_stack[t_depth - 1] : 0;
    if (id) *id = last;
    return 0;
}

uint64_t gc_steps_lookup(uint32_t corr)
{
    _Atomic uint64_t *map = atomic_load_explicit(&g_map, memory_order_relaxed);
    if (!map) return 0;
    uint64_t e = atomic_load_explicit(&map[corr & (GC_LAUNCH_SLOTS - 1)], memory_order_acquire);
    return (uint32_t)(e >> 32) == corr ? (uint32_t)e : 0;
}

int gc_steps_in_use(void) { return atomic_load_explicit(&g_map, memory_order_relaxed) != NULL; }
