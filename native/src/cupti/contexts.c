/*
 * contexts.c - the kernel kind switched per CUDA context, not globally.
 *
 * Why: with CUPTI 13.5 on driver 580, switching CONCURRENT_KERNEL off and on again with
 * cuptiActivityDisable/Enable while a process launches kernels stops its eager kernel records for good
 * after a few switches, with no drop reported; copies and graph records go on (CUPTI alone:
 * a CUPTI-only reproduction showed it without the census). The census switches that kind at every duty
 * cycle, pause and mode change. cuptiActivityEnableContext/DisableContext on the same load kept every
 * record through every switch. So the kind is enabled globally once (new contexts start traced) and
 * from then on switched per context: every context the census knows of.
 *
 * Contexts become known from CUPTI's CONTEXT_CREATED callbacks and the active primary contexts when CUPTI is set
 * up. They are forgotten at
 * CONTEXT_DESTROY_STARTING. Only the flusher thread calls CUPTI here, never under the set's lock (a
 * CUPTI call may wait on locks held by a thread that is inside a CUPTI callback and wants this one);
 * a context destroyed while the flusher switches it waits for that pass, at most 50 ms.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "cupti_api.h"
#include "internal.h"

#define MAX_CONTEXTS 64

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(CUcontext) g_ctx[MAX_CONTEXTS]; /* NULL: free slot; read without the lock to skip it */
static uint8_t g_applied[MAX_CONTEXTS];         /* state last given to CUPTI: 0 off, 1 on, 2 not yet */
static atomic_int g_switching;                  /* the flusher is inside a pass */
static atomic_ullong g_full;                    /* contexts not kept: the set was full */

int gc_contexts_known(CUcontext ctx)
{
    for (int i = 0; i < MAX_CONTEXTS; i++)
        if (atomic_load_explicit(&g_ctx[i], memory_order_acquire) == ctx) return 1;
    return 0;
}

void gc_contexts_add(CUcontext ctx)
{
    if (!ctx || gc_contexts_known(ctx)) return;
    pthread_mutex_lock(&g_lock);
    int free_slot = -1, have = 0;
    for (int i = 0; i < MAX_CONTEXTS; i++) {
        CUcontext c = atomic_load(&g_ctx[i]);
        if (c == ctx) have = 1;
        if (!c && free_slot < 0) free_slot = i;
    }
    if (!have && free_slot >= 0) {
        g_applied[free_slot] = 2;
        atomic_store_explicit(&g_ctx[free_slot], ctx, memory_order_release);
    } else if (!have) {
        atomic_fetch_add(&g_full, 1);
    }
    pthread_mutex_unlock(&g_lock);
}

void gc_contexts_remove(CUcontext ctx)
{
    if (!ctx) return;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_CONTEXTS; i++)
        if (atomic_load(&g_ctx[i]) == ctx) atomic_store(&g_ctx[i], NULL);
    pthread_mutex_unlock(&g_lock);
    /* the flusher may hold this handle in a pass: let it finish before the context goes (bounded) */
    for (int waited = 0; atomic_load(&g_switching) && waited < 500; waited++) {
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
}

/* Kernel records on (1) or off (0) for every known context; `only_new`: only those not yet given a
 * state. A context never switched follows the global setting: with `global_on`, on needs no call (so a
 * census that never switches, every kernel traced, never asks CUPTI for per-context settings). Returns
 * how many contexts now have it, or -1 when CUPTI refused one (the caller switches globally then). The
 * flusher's only. */
int gc_contexts_switch(int on, int only_new, int global_on)
{
    int n = 0, failed = 0;
    atomic_store(&g_switching, 1);
    for (int i = 0; i < MAX_CONTEXTS; i++) {
        pthread_mutex_lock(&g_lock);
        CUcontext c = atomic_load(&g_ctx[i]);
        int skip = !c || (only_new && g_applied[i] != 2) || g_applied[i] == (uint8_t)on;
        if (!skip && on && global_on && g_applied[i] == 2) { /* follows the global setting: on already */
            g_applied[i] = 1;
            skip = 1;
        }
        pthread_mutex_unlock(&g_lock);
        if (!c) continue;
        if (skip) { n++; continue; }
        if (gc_cupti_kernels_context(c, on) == CUPTI_SUCCESS) {
            pthread_mutex_lock(&g_lock);
            if (atomic_load(&g_ctx[i]) == c) g_applied[i] = (uint8_t)on;
            pthread_mutex_unlock(&g_lock);
            n++;
        } else {
            failed = 1;
        }
    }
    atomic_store(&g_switching, 0);
    return failed ? -1 : n;
}

uint64_t gc_contexts_full(void) { return atomic_load(&g_full); }

int gc_contexts_new(void)
{
    int n = 0;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_CONTEXTS; i++)
        if (atomic_load(&g_ctx[i]) && g_applied[i] == 2) n++;
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* A forked child: the parent's contexts are not its own (and the lock may have been held). */
void gc_contexts_forget(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    g_lock = fresh;
    for (int i = 0; i < MAX_CONTEXTS; i++) atomic_store(&g_ctx[i], NULL);
    atomic_store(&g_switching, 0);
}
