/*
 * steps.c - which step launched each piece of GPU work.
 *
 * gc_step_begin(id) pushes id on the calling thread's own stack. Whatever sees the calls that launch work (kernels,
 * graph launches, copies, memsets) notes "correlation id -> the thread's innermost step" here (gc_steps_note) in a
 * lock-free table: the preloaded wrappers (interpose.c) or CUPTI's callbacks (step_callbacks.c); the tally looks
 * each record's correlation id up there. Eager launches counted at the calls are marked per step by the collector
 * that counts them (gc_steps_marks: launches.c).
 *
 * The table is direct-mapped by correlation id (numbered in increasing order), one 64-bit
 * word per slot: (correlation id << 32) | step id, so a reader never sees half an entry. A slot is
 * reused after GC_LAUNCH_SLOTS launches; a record that arrives later than that finds another id there
 * and counts as unmatched, never as another step's. Allocated at the first step: 8 MiB, only in
 * processes that use steps.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define GC_LAUNCH_SLOTS (1u << 20)     /* power of two: ~26 s of launches at 40,000 a second */

static _Atomic(_Atomic uint64_t *) g_map;
static __thread uint32_t t_stack[GC_STEP_DEPTH];
static __thread uint32_t t_depth;
static __thread uint32_t t_top;        /* t_stack[t_depth - 1], or 0: what the callback reads */
/* The collector's per-step marks (launches.c): set at start, before any step begins; NULL under CUPTI. */
static void (*g_mark_push)(uint32_t depth), (*g_mark_pop)(uint32_t depth, uint32_t id);

void gc_steps_marks(void (*push)(uint32_t depth), void (*pop)(uint32_t depth, uint32_t id))
{
    g_mark_push = push;
    g_mark_pop = pop;
}

void gc_steps_note(uint32_t corr)
{
    uint32_t id = t_top;
    if (!id) return;
    _Atomic uint64_t *map = atomic_load_explicit(&g_map, memory_order_relaxed);
    if (map) atomic_store_explicit(&map[corr & (GC_LAUNCH_SLOTS - 1)], ((uint64_t)corr << 32) | id, memory_order_release);
}

int gc_steps_start(int (*follow)(void))
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
            /* follow: what turns the noting of calls on (NULL: the preloaded wrappers note each call already) */
            if (!follow || follow() == 0) s = 1;
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
    if (g_mark_push) g_mark_push(t_depth);
    t_stack[t_depth++] = (uint32_t)id;
    t_top = (uint32_t)id;
    return 0;
}

int gc_steps_pop(uint64_t *id)
{
    if (t_depth == 0) return -1;
    if (g_mark_pop) g_mark_pop(t_depth, t_stack[t_depth - 1]);
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
