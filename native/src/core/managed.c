/*
 * managed.c - managed (unified) memory made, advised, prefetched and freed in the process, per device, as the calls
 * report it: the default collector's wrappers (interpose.c) and the precise collector's driver callbacks (injector.c)
 * both hand their calls' parameters here (laid out as CUPTI's params, managed_params.h).
 *
 * Why: pages of managed memory move between host and device when either touches them, and no copy call names
 * those moves. The default collector cannot see them at all, so it must at least know that managed memory is in use
 * (the census then says migrations were not measured); the precise collector turns CUPTI's unified-memory counters
 * on at the first managed allocation.
 *
 * The calling thread pays a few relaxed atomic adds; an allocation also one slot of a bounded table (its address
 * and size, so that a free can take it off the live bytes), a free one probe of that table while any managed
 * allocation is live. The flusher copies the counters into the segment (gc_managed_publish, under the writer's lock).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include <cuda.h>

#include "internal.h"
#include "managed_params.h"

static struct {
    _Atomic uint64_t allocs, alloc_bytes, live_bytes, advises, pf_in, pf_in_bytes, pf_out, pf_out_bytes;
} g_dev[GC_MAX_DEVICES];
static _Atomic int g_any;                /* a managed allocation was made (on any device, or on none we know) */
static _Atomic uint64_t g_gen, g_published;   /* calls counted; of them, in the segment (the flusher's) */

/* Live allocations, open addressing (linear probing): 0 empty, FREED a freed slot (probing goes past it), TAKEN a
 * slot being written. Full: the allocation stays in live_bytes for good (a census that cannot follow the free keeps
 * saying "in use"). */
#define LIVE_SLOTS 8192u
#define FREED 1u
#define TAKEN 2u
static struct live {
    _Atomic uint64_t ptr;
    uint64_t bytes;
    uint32_t dev;
} g_live[LIVE_SLOTS];
static _Atomic uint64_t g_live_n;        /* slots holding an allocation */

static inline uint32_t slot_of(uint64_t p) { return (uint32_t)((p >> 12) * 0x9E3779B97F4A7C15ull >> 51) & (LIVE_SLOTS - 1); }

static void remember(uint64_t p, uint64_t bytes, uint32_t dev)
{
    if (p <= TAKEN) return;
    for (uint32_t i = 0, s = slot_of(p); i < LIVE_SLOTS; i++, s = (s + 1) & (LIVE_SLOTS - 1)) {
        uint64_t cur = atomic_load_explicit(&g_live[s].ptr, memory_order_relaxed);
        if ((cur != 0 && cur != FREED) ||
            !atomic_compare_exchange_strong_explicit(&g_live[s].ptr, &cur, TAKEN, memory_order_acquire, memory_order_relaxed))
            continue;   /* held, or taken by another thread just now */
        g_live[s].bytes = bytes;
        g_live[s].dev = dev;
        atomic_store_explicit(&g_live[s].ptr, p, memory_order_release);
        atomic_fetch_add_explicit(&g_live_n, 1, memory_order_relaxed);
        return;
    }
}

void gc_managed_alloc(int dev, uint64_t ptr, uint64_t bytes)
{
    atomic_store_explicit(&g_any, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&g_gen, 1, memory_order_relaxed);
    if (dev < 0 || dev >= (int)GC_MAX_DEVICES) return;
    atomic_fetch_add_explicit(&g_dev[dev].allocs, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&g_dev[dev].alloc_bytes, bytes, memory_order_relaxed);
    atomic_fetch_add_explicit(&g_dev[dev].live_bytes, bytes, memory_order_relaxed);
    remember(ptr, bytes, (uint32_t)dev);
}

void gc_managed_free(uint64_t ptr)
{
    if (ptr <= TAKEN || !atomic_load_explicit(&g_live_n, memory_order_relaxed)) return;
    for (uint32_t i = 0, s = slot_of(ptr); i < LIVE_SLOTS; i++, s = (s + 1) & (LIVE_SLOTS - 1)) {
        uint64_t cur = atomic_load_explicit(&g_live[s].ptr, memory_order_acquire);
        if (cur == 0) return;                       /* never a managed allocation we followed */
        if (cur != ptr) continue;
        uint64_t bytes = g_live[s].bytes;
        uint32_t dev = g_live[s].dev;
        if (!atomic_compare_exchange_strong_explicit(&g_live[s].ptr, &cur, FREED, memory_order_acq_rel, memory_order_relaxed))
            return;                                 /* freed twice at once: the driver refuses one of them */
        atomic_fetch_sub_explicit(&g_live_n, 1, memory_order_relaxed);
        atomic_fetch_sub_explicit(&g_dev[dev].live_bytes, bytes, memory_order_relaxed);
        atomic_fetch_add_explicit(&g_gen, 1, memory_order_relaxed);
        return;
    }
}

static void prefetched(int dev, int to_host, uint64_t n, uint64_t bytes)
{
    if (dev < 0 || dev >= (int)GC_MAX_DEVICES || !bytes) return;
    atomic_fetch_add_explicit(&g_gen, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(to_host ? &g_dev[dev].pf_out : &g_dev[dev].pf_in, n, memory_order_relaxed);
    atomic_fetch_add_explicit(to_host ? &g_dev[dev].pf_out_bytes : &g_dev[dev].pf_in_bytes, bytes, memory_order_relaxed);
}

/* A prefetch's target: the device it names (to the device), or the host (counted on the calling device). */
static void prefetch_to(CUmemLocation loc, int dev, uint64_t bytes)
{
    if (loc.type == CU_MEM_LOCATION_TYPE_DEVICE) prefetched(loc.id, 0, 1, bytes);
    else prefetched(dev, 1, 1, bytes);
}

static void batch(const struct p_mbatch *q, int dev)
{
    if (!q->dptrs || !q->sizes || !q->locs || !q->loc_idx || !q->nlocs || q->count > (1u << 24)) return;
    size_t loc = 0;
    for (size_t i = 0; i < q->count; i++) {
        while (loc + 1 < q->nlocs && q->loc_idx[loc + 1] <= i) loc++;
        prefetch_to(q->locs[loc], dev, q->sizes[i]);
    }
}

/* Whether the driver says `p` is managed memory (an allocation from a pool of managed memory). */
static int is_managed(CUdeviceptr p)
{
    static CUresult (*_Atomic attr)(void *, CUpointer_attribute, CUdeviceptr);
    CUresult (*f)(void *, CUpointer_attribute, CUdeviceptr) = atomic_load_explicit(&attr, memory_order_acquire);
    if (!f) {
        void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        *(void **)&f = cuda ? dlsym(cuda, "cuPointerGetAttribute") : NULL;
        if (!f) return 0;
        atomic_store_explicit(&attr, f, memory_order_release);
    }
    unsigned int managed = 0;
    return f(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, p) == CUDA_SUCCESS && managed;
}

int gc_managed_call(int call, const void *p, int dev)
{
    switch (call) {
    case GC_M_ALLOC: {
        const struct p_malloc *q = p;
        if (q->dptr) gc_managed_alloc(dev, (uint64_t)*q->dptr, q->bytes);
        return 0;
    }
    case GC_M_POOL_ALLOC: {   /* from a pool: managed when the pool is (CUDA 13's managed pools) */
        const struct p_mpool *q = p;
        if (q->dptr && *q->dptr && is_managed(*q->dptr)) gc_managed_alloc(dev, (uint64_t)*q->dptr, q->bytes);
        return 0;
    }
    case GC_M_FREE: gc_managed_free((uint64_t)((const struct p_mfree *)p)->ptr); return 0;
    case GC_M_ADVISE:
    case GC_M_ADVISE2:
        if (dev >= 0 && dev < (int)GC_MAX_DEVICES) {
            atomic_fetch_add_explicit(&g_dev[dev].advises, 1, memory_order_relaxed);
            atomic_fetch_add_explicit(&g_gen, 1, memory_order_relaxed);
        }
        return 0;
    case GC_M_PREFETCH: {   /* CUDA 12's: a device ordinal, CU_DEVICE_CPU (-1) for the host */
        const struct p_mprefetch1 *q = p;
        if (q->to >= 0) prefetched(q->to, 0, 1, q->bytes);
        else prefetched(dev, 1, 1, q->bytes);
        return 0;
    }
    case GC_M_PREFETCH2: prefetch_to(((const struct p_mprefetch2 *)p)->loc, dev, ((const struct p_mprefetch2 *)p)->bytes); return 0;
    case GC_M_PREFETCH_BATCH: batch(p, dev); return 0;
    default: return -1;
    }
}

int gc_managed_any(void) { return atomic_load_explicit(&g_any, memory_order_relaxed); }

int gc_managed_pending(void)
{
    return atomic_load_explicit(&g_gen, memory_order_relaxed) != atomic_load_explicit(&g_published, memory_order_relaxed);
}

void gc_managed_publish(gc_segment *seg)
{
    atomic_store_explicit(&g_published, atomic_load_explicit(&g_gen, memory_order_relaxed), memory_order_relaxed);
    if (atomic_load_explicit(&g_any, memory_order_relaxed)) seg->flags |= GC_FLAG_MANAGED;
    for (uint32_t d = 0; d < GC_MAX_DEVICES; d++) {
        gc_managed *m = &seg->devices[d].managed;
        uint64_t v[8] = {atomic_load(&g_dev[d].allocs), atomic_load(&g_dev[d].alloc_bytes),
                         atomic_load(&g_dev[d].live_bytes), atomic_load(&g_dev[d].advises), atomic_load(&g_dev[d].pf_in),
                         atomic_load(&g_dev[d].pf_in_bytes), atomic_load(&g_dev[d].pf_out),
                         atomic_load(&g_dev[d].pf_out_bytes)};
        static const uint64_t zero[8];
        if (!memcmp(v, zero, sizeof(v))) continue;
        if (!seg->devices[d].in_use) {
            seg->devices[d].in_use = 1;
            seg->devices[d].device_id = d;
        }
        m->allocs = v[0];
        m->alloc_bytes = v[1];
        m->live_bytes = v[2];
        m->advises = v[3];
        m->prefetch_in.count = v[4];
        m->prefetch_in.bytes = v[5];
        m->prefetch_out.count = v[6];
        m->prefetch_out.bytes = v[7];
    }
}

int gc_managed_cbid(CUpti_CallbackId cbid)
{
    switch (cbid) {
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocManaged: return GC_M_ALLOC;
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync: case CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync: case CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync_ptsz:
        return GC_M_POOL_ALLOC;
    case CUPTI_DRIVER_TRACE_CBID_cuMemFree_v2: case CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync:
    case CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync_ptsz:
        return GC_M_FREE;
    case CUPTI_DRIVER_TRACE_CBID_cuMemAdvise: return GC_M_ADVISE;
    case CUPTI_DRIVER_TRACE_CBID_cuMemAdvise_v2: return GC_M_ADVISE2;
    case CUPTI_DRIVER_TRACE_CBID_cuMemPrefetchAsync: case CUPTI_DRIVER_TRACE_CBID_cuMemPrefetchAsync_ptsz:
        return GC_M_PREFETCH;
    case CUPTI_DRIVER_TRACE_CBID_cuMemPrefetchAsync_v2: case CUPTI_DRIVER_TRACE_CBID_cuMemPrefetchAsync_v2_ptsz:
        return GC_M_PREFETCH2;
    case CUPTI_DRIVER_TRACE_CBID_cuMemPrefetchBatchAsync: case CUPTI_DRIVER_TRACE_CBID_cuMemPrefetchBatchAsync_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuMemDiscardAndPrefetchBatchAsync:
    case CUPTI_DRIVER_TRACE_CBID_cuMemDiscardAndPrefetchBatchAsync_ptsz:
        return GC_M_PREFETCH_BATCH;
    default: return GC_M_NONE;
    }
}
