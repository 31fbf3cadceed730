/*
 * calls.c - copies, memsets and graph launches counted at their driver calls, by the library preloaded (interpose.c
 * hands each successful call's arguments here; the default collector).
 *
 * What the census must get exact is visible at the calls: kernel launches (launches.c), graph contents
 * (graphs.c), and here the copy and memset calls' parameters: bytes, direction from the two ends, the host end
 * pinned or pageable as the driver knows the pointer (copy_class.c); a batch's copies each from the
 * caller's arrays. What no call says is how long the work ran: copy and memset durations are not measured.
 * A call counts when it succeeded and did not record into a stream capture (its graph's launches count it).
 *
 * The launching thread does a bounded amount: up to six pointer queries for a copy whose ends the call does not
 * name, the clock, and one slot of a bounded lock-free queue (Vyukov's: a sequence number per cell). The flusher
 * empties it under the injector's lock (gc_calls_fold) and tallies each call as a record of zero duration. A full
 * queue drops the call and counts it (calls_lost): bounded memory, never a wait.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <cuda.h>

#include "call_params.h"
#include "internal.h"

#define QUEUE_CELLS 16384u               /* power of two; the flusher empties it every 20 ms or sooner */

/* What a driver call is, by its parameters' layout (call_params.h). */
enum shape {
    S_NONE = 0,
    S_GENERIC,      /* cuMemcpy(Async): dst, src, bytes, stream; both ends asked of the driver */
    S_HTOD,         /* dstDevice, srcHost, bytes, stream */
    S_DTOH,         /* dstHost, srcDevice, bytes, stream */
    S_DTOD,         /* dstDevice, srcDevice, bytes, stream */
    S_DTOA,         /* dstArray, dstOffset, srcDevice, bytes */
    S_ATOD,         /* dstDevice, srcArray, srcOffset, bytes */
    S_HTOA,         /* dstArray, dstOffset, srcHost, bytes, stream */
    S_ATOH,         /* dstHost, srcArray, srcOffset, bytes, stream */
    S_ATOA,         /* dstArray, dstOffset, srcArray, srcOffset, bytes */
    S_PEER,         /* dstDevice, dstContext, srcDevice, srcContext, bytes, stream */
    S_2D,           /* const CUDA_MEMCPY2D *, stream */
    S_3D,           /* const CUDA_MEMCPY3D *, stream */
    S_3DPEER,       /* const CUDA_MEMCPY3D_PEER *, stream */
    S_SET,          /* dstDevice, value, N, stream (elements of 1, 2 or 4 bytes) */
    S_SET2D,        /* dstDevice, dstPitch, value, Width, Height, stream */
    S_BATCH,        /* cuMemcpyBatchAsync_v2: dsts[], srcs[], sizes[], count, attributes, stream */
    S_BATCH1,       /* cuMemcpyBatchAsync (CUDA 12.8's): the same with failIdx before the stream */
    S_BATCH3D,      /* cuMemcpy3DBatchAsync_v2: numOps, opList[], flags, stream */
    S_BATCH3D1,     /* cuMemcpy3DBatchAsync (12.8's): numOps, opList[], failIdx, flags, stream */
    S_ATTR,         /* cuMemcpyWithAttributesAsync: dst, src, bytes, attributes, stream */
    S_ATTR3D,       /* cuMemcpy3DWithAttributesAsync: one op, flags, stream */
    S_GRAPH,        /* cuGraphLaunch: exec, stream */
};

static const struct {
    const char *name;
    uint8_t shape, elem, async;   /* elem: memset element bytes; async: a stream follows */
} g_table[] = {
    {"cuMemcpy", S_GENERIC, 0, 0}, {"cuMemcpyAsync", S_GENERIC, 0, 1},
    {"cuMemcpyHtoD_v2", S_HTOD, 0, 0}, {"cuMemcpyHtoDAsync_v2", S_HTOD, 0, 1},
    {"cuMemcpyDtoH_v2", S_DTOH, 0, 0}, {"cuMemcpyDtoHAsync_v2", S_DTOH, 0, 1},
    {"cuMemcpyDtoD_v2", S_DTOD, 0, 0}, {"cuMemcpyDtoDAsync_v2", S_DTOD, 0, 1},
    {"cuMemcpyDtoA_v2", S_DTOA, 0, 0}, {"cuMemcpyAtoD_v2", S_ATOD, 0, 0},
    {"cuMemcpyHtoA_v2", S_HTOA, 0, 0}, {"cuMemcpyHtoAAsync_v2", S_HTOA, 0, 1},
    {"cuMemcpyAtoH_v2", S_ATOH, 0, 0}, {"cuMemcpyAtoHAsync_v2", S_ATOH, 0, 1},
    {"cuMemcpyAtoA_v2", S_ATOA, 0, 0},
    {"cuMemcpyPeer", S_PEER, 0, 0}, {"cuMemcpyPeerAsync", S_PEER, 0, 1},
    {"cuMemcpy2D_v2", S_2D, 0, 0}, {"cuMemcpy2DUnaligned_v2", S_2D, 0, 0}, {"cuMemcpy2DAsync_v2", S_2D, 0, 1},
    {"cuMemcpy3D_v2", S_3D, 0, 0}, {"cuMemcpy3DAsync_v2", S_3D, 0, 1},
    {"cuMemcpy3DPeer", S_3DPEER, 0, 0}, {"cuMemcpy3DPeerAsync", S_3DPEER, 0, 1},
    {"cuMemsetD8_v2", S_SET, 1, 0}, {"cuMemsetD16_v2", S_SET, 2, 0}, {"cuMemsetD32_v2", S_SET, 4, 0},
    {"cuMemsetD8Async", S_SET, 1, 1}, {"cuMemsetD16Async", S_SET, 2, 1}, {"cuMemsetD32Async", S_SET, 4, 1},
    {"cuMemsetD2D8_v2", S_SET2D, 1, 0}, {"cuMemsetD2D16_v2", S_SET2D, 2, 0}, {"cuMemsetD2D32_v2", S_SET2D, 4, 0},
    {"cuMemsetD2D8Async", S_SET2D, 1, 1}, {"cuMemsetD2D16Async", S_SET2D, 2, 1}, {"cuMemsetD2D32Async", S_SET2D, 4, 1},
    {"cuMemcpyBatchAsync", S_BATCH1, 0, 1}, {"cuMemcpyBatchAsync_v2", S_BATCH, 0, 1},
    {"cuMemcpy3DBatchAsync", S_BATCH3D1, 0, 1}, {"cuMemcpy3DBatchAsync_v2", S_BATCH3D, 0, 1},
    {"cuMemcpyWithAttributesAsync", S_ATTR, 0, 1}, {"cuMemcpy3DWithAttributesAsync", S_ATTR3D, 0, 1},
    {"cuGraphLaunch", S_GRAPH, 0, 1},
};
#define NTABLE (sizeof(g_table) / sizeof(g_table[0]))

static atomic_int g_started, g_counting;
static int64_t g_gpu_minus_mono;
static CUresult (*g_ctx_device)(CUdevice *, CUcontext);   /* cuCtxGetDevice_v2: a peer's device without CUPTI */
static CUresult (*g_array_desc)(CUDA_ARRAY3D_DESCRIPTOR *, CUarray);   /* an array operand's element size */

static struct cell {
    _Atomic uint64_t seq;
    gc_call c;
} g_q[QUEUE_CELLS];
static _Atomic uint64_t g_enq, g_lost;
static _Atomic uint64_t g_deq;           /* moved by the fold (under the injector's lock), read by pending */
static _Atomic uint64_t f_lost;          /* the fold's (under the injector's lock); gc_calls_pending reads it unlocked */

int gc_calls_start(int64_t gpu_minus_mono)
{
    if (atomic_load(&g_started)) return 0;
    g_gpu_minus_mono = gpu_minus_mono;
    for (uint64_t i = 0; i < QUEUE_CELLS; i++) atomic_store_explicit(&g_q[i].seq, i, memory_order_relaxed);
    atomic_store(&g_enq, 0);
    atomic_store(&g_deq, 0);
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (cuda) {
        *(void **)&g_ctx_device = dlsym(cuda, "cuCtxGetDevice_v2");
        *(void **)&g_array_desc = dlsym(cuda, "cuArray3DGetDescriptor_v2");
    }
    atomic_store(&g_counting, 1);
    atomic_store(&g_started, 1);
    return 0;
}

void gc_calls_set_counting(int on) { atomic_store(&g_counting, on && atomic_load(&g_started)); }

static void push(const gc_call *c)
{
    uint64_t pos = atomic_load_explicit(&g_enq, memory_order_relaxed);
    for (;;) {
        struct cell *cell = &g_q[pos & (QUEUE_CELLS - 1)];
        uint64_t seq = atomic_load_explicit(&cell->seq, memory_order_acquire);
        int64_t diff = (int64_t)(seq - pos);
        if (diff == 0) {
            if (atomic_compare_exchange_weak_explicit(&g_enq, &pos, pos + 1, memory_order_relaxed, memory_order_relaxed)) {
                cell->c = *c;
                atomic_store_explicit(&cell->seq, pos + 1, memory_order_release);
                return;
            }
        } else if (diff < 0) { /* full: the flusher is behind */
            atomic_fetch_add_explicit(&g_lost, 1, memory_order_relaxed);
            return;
        } else {
            pos = atomic_load_explicit(&g_enq, memory_order_relaxed);
        }
    }
}

static CUstream stream_of(uint8_t shape, const void *p)
{
    switch (shape) {
    case S_GENERIC: case S_DTOD: return ((const struct p_generic *)p)->stream;
    case S_HTOD: return ((const struct p_htod *)p)->stream;
    case S_DTOH: return ((const struct p_dtoh *)p)->stream;
    case S_HTOA: return ((const struct p_htoa *)p)->stream;
    case S_ATOH: return ((const struct p_atoh *)p)->stream;
    case S_PEER: return ((const struct p_peer *)p)->stream;
    case S_2D: case S_3D: case S_3DPEER: case S_GRAPH: return ((const struct p_ptr *)p)->stream;
    case S_SET: return ((const struct p_set *)p)->stream;
    case S_SET2D: return ((const struct p_set2d *)p)->stream;
    case S_BATCH: return ((const struct p_batch *)p)->stream;
    case S_BATCH1: return ((const struct p_batch1 *)p)->stream;
    case S_BATCH3D: return ((const struct p_batch3d *)p)->stream;
    case S_BATCH3D1: return ((const struct p_batch3d1 *)p)->stream;
    case S_ATTR: return ((const struct p_attr *)p)->stream;
    case S_ATTR3D: return ((const struct p_attr3d *)p)->stream;
    default: return NULL;
    }
}

/* The device of a peer copy's context, as the driver says. */
static int ctx_device(CUcontext ctx, uint32_t *dev)
{
    CUdevice d = 0;
    if (!g_ctx_device || g_ctx_device(&d, ctx) != CUDA_SUCCESS || d < 0) return -1;
    *dev = (uint32_t)d;
    return 0;
}

static void classify(gc_call *c, CUmemorytype st, const void *sh, CUdeviceptr sd, CUmemorytype dt, const void *dh,
                     CUdeviceptr dd)
{
    int dir, mem, peer;
    gc_copy_class(st, sh, sd, dt, dh, dd, &dir, &mem, &peer);
    c->dir = (uint8_t)dir;
    c->mem = (uint8_t)mem;
    c->peer_dev = peer >= 0 && peer < (int)GC_MAX_DEVICES ? (uint8_t)peer : 0;
    if (dir == GC_DIR_PTOP && peer < 0) c->dir = GC_DIR_DTOD;
}

/* A copy between host memory and an end the call names as the device's (memory or an array): only the host
 * end is asked of the driver (pinned or pageable). */
static void host_copy(gc_call *c, size_t bytes, const void *host, int to_device)
{
    c->bytes = bytes;
    if (to_device) classify(c, CU_MEMORYTYPE_HOST, host, 0, CU_MEMORYTYPE_ARRAY, NULL, 0);
    else classify(c, CU_MEMORYTYPE_ARRAY, NULL, 0, CU_MEMORYTYPE_HOST, host, 0);
}

/* What the call put on the GPU: 0, or -1 when its size cannot be read. */
static int read_call(uint8_t shape, uint8_t elem, const void *p, gc_call *c)
{
    const CUmemorytype D = CU_MEMORYTYPE_DEVICE, U = CU_MEMORYTYPE_UNIFIED;
    c->what = GC_CALL_COPY;
    switch (shape) {
    case S_ATTR: {
        const struct p_attr *q = p;
        c->bytes = q->bytes;
        classify(c, U, (const void *)(uintptr_t)q->src, q->src, U, (const void *)(uintptr_t)q->dst, q->dst);
        return 0;
    }
    case S_GENERIC: {
        const struct p_generic *q = p;
        c->bytes = q->bytes;
        classify(c, U, (const void *)(uintptr_t)q->src, q->src, U, (const void *)(uintptr_t)q->dst, q->dst);
        return 0;
    }
    case S_HTOD: host_copy(c, ((const struct p_htod *)p)->bytes, ((const struct p_htod *)p)->src, 1); return 0;
    case S_DTOH: host_copy(c, ((const struct p_dtoh *)p)->bytes, ((const struct p_dtoh *)p)->dst, 0); return 0;
    case S_DTOD: {
        const struct p_generic *q = p;
        c->bytes = q->bytes;
        classify(c, D, NULL, q->src, D, NULL, q->dst);
        return 0;
    }
    case S_DTOA: c->bytes = ((const struct p_dtoa *)p)->bytes; c->dir = GC_DIR_DTOD; c->mem = GC_MEM_DEVICE; return 0;
    case S_ATOD: c->bytes = ((const struct p_atod *)p)->bytes; c->dir = GC_DIR_DTOD; c->mem = GC_MEM_DEVICE; return 0;
    case S_ATOA: c->bytes = ((const struct p_atoa *)p)->bytes; c->dir = GC_DIR_DTOD; c->mem = GC_MEM_DEVICE; return 0;
    case S_HTOA: host_copy(c, ((const struct p_htoa *)p)->bytes, ((const struct p_htoa *)p)->src, 1); return 0;
    case S_ATOH: host_copy(c, ((const struct p_atoh *)p)->bytes, ((const struct p_atoh *)p)->dst, 0); return 0;
    case S_PEER: {
        const struct p_peer *q = p;
        uint32_t sdev = 0, ddev = 0;
        c->bytes = q->bytes;
        c->mem = GC_MEM_DEVICE;
        if (ctx_device(q->sctx, &sdev) != 0 || ctx_device(q->dctx, &ddev) != 0 ||
            sdev >= GC_MAX_DEVICES || ddev >= GC_MAX_DEVICES)
            return -1;
        c->dev = (uint8_t)sdev;
        c->peer_dev = (uint8_t)ddev;
        c->dir = sdev == ddev ? GC_DIR_DTOD : GC_DIR_PTOP;
        return 0;
    }
    case S_2D: {
        const CUDA_MEMCPY2D *m = ((const struct p_ptr *)p)->p;
        if (!m) return -1;
        c->bytes = (uint64_t)m->WidthInBytes * (m->Height ? m->Height : 1);
        classify(c, m->srcMemoryType, m->srcHost, m->srcDevice, m->dstMemoryType, m->dstHost, m->dstDevice);
        return 0;
    }
    case S_3D: {
        const CUDA_MEMCPY3D *m = ((const struct p_ptr *)p)->p;
        if (!m) return -1;
        c->bytes = (uint64_t)m->WidthInBytes * (m->Height ? m->Height : 1) * (m->Depth ? m->Depth : 1);
        classify(c, m->srcMemoryType, m->srcHost, m->srcDevice, m->dstMemoryType, m->dstHost, m->dstDevice);
        return 0;
    }
    case S_3DPEER: {
        const CUDA_MEMCPY3D_PEER *m = ((const struct p_ptr *)p)->p;
        uint32_t sdev = 0, ddev = 0;
        if (!m || ctx_device(m->srcContext, &sdev) != 0 || ctx_device(m->dstContext, &ddev) != 0 ||
            sdev >= GC_MAX_DEVICES || ddev >= GC_MAX_DEVICES)
            return -1;
        c->bytes = (uint64_t)m->WidthInBytes * (m->Height ? m->Height : 1) * (m->Depth ? m->Depth : 1);
        classify(c, m->srcMemoryType, m->srcHost, m->srcDevice, m->dstMemoryType, m->dstHost, m->dstDevice);
        if (c->dir == GC_DIR_DTOD || c->dir == GC_DIR_PTOP) {
            c->dev = (uint8_t)sdev;
            c->peer_dev = (uint8_t)ddev;
            c->dir = sdev == ddev ? GC_DIR_DTOD : GC_DIR_PTOP;
        }
        return 0;
    }
    case S_SET: c->what = GC_CALL_MEMSET; c->bytes = (uint64_t)((const struct p_set *)p)->n * elem; return 0;
    case S_SET2D: {
        const struct p_set2d *q = p;
        c->what = GC_CALL_MEMSET;
        c->bytes = (uint64_t)q->width * elem * (q->height ? q->height : 1);
        return 0;
    }
    case S_GRAPH: c->what = GC_CALL_GRAPH; return 0;
    default: return -1;
    }
}

/* ---- batches: many copies in one call ----
 * Each copy is sized and classed from the caller's arrays (the driver accepted the call, so they are readable),
 * and the copies of one class (direction, host memory kind, devices) go to the flusher as one call of `copies`
 * copies: a batch of thousands of blocks takes a few queue cells, not thousands. */
#define BATCH_MAX_COPIES (1u << 24)    /* more is not a batch the driver takes: said as lost, never read */
#define BATCH_CLASSES 8

struct batch {
    gc_call c[BATCH_CLASSES];
    int n;
};

static void batch_flush(struct batch *b)
{
    for (int i = 0; i < b->n; i++) push(&b->c[i]);
    b->n = 0;
}

static void batch_add(struct batch *b, const gc_call *one)
{
    if (one->bytes == 0) return;   /* no work */
    for (int i = 0; i < b->n; i++) {
        gc_call *c = &b->c[i];
        if (c->dir == one->dir && c->mem == one->mem && c->dev == one->dev && c->peer_dev == one->peer_dev &&
            c->copies < UINT32_MAX) {
            c->bytes += one->bytes;
            c->copies++;
            return;
        }
    }
    if (b->n == BATCH_CLASSES) batch_flush(b);
    b->c[b->n] = *one;
    b->c[b->n].copies = 1;
    b->n++;
}

/* An array operand's element size in bytes (0: unknown). */
static uint64_t array_elem(CUarray a)
{
    CUDA_ARRAY3D_DESCRIPTOR d;
    if (!a || !g_array_desc || g_array_desc(&d, a) != CUDA_SUCCESS) return 0;
    uint64_t size;
    switch (d.Format) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8: size = 1; break;
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: case CU_AD_FORMAT_HALF: size = 2; break;
    case CU_AD_FORMAT_UNSIGNED_INT32: case CU_AD_FORMAT_SIGNED_INT32: case CU_AD_FORMAT_FLOAT: size = 4; break;
    default: return 0;   /* block-compressed and packed formats: not sized */
    }
    return size * (d.NumChannels ? d.NumChannels : 1);
}

/* One op of a 3D batch: 0, or -1 when it cannot be sized (an array of a format we do not size). */
static int read_op(const CUDA_MEMCPY3D_BATCH_OP *op, gc_call *c)
{
    const CUmemcpy3DOperand *s = &op->src, *d = &op->dst;
    int sp = s->type == CU_MEMCPY_OPERAND_TYPE_POINTER, dp = d->type == CU_MEMCPY_OPERAND_TYPE_POINTER;
    /* pointer to pointer: elements of one byte; otherwise the array's element size */
    uint64_t elem = sp && dp ? 1 : array_elem(sp ? d->op.array.array : s->op.array.array);
    if (!elem) return -1;
    c->bytes = elem * op->extent.width * (op->extent.height ? op->extent.height : 1) *
               (op->extent.depth ? op->extent.depth : 1);
    CUdeviceptr sd = sp ? s->op.ptr.ptr : 0, dd = dp ? d->op.ptr.ptr : 0;
    classify(c, sp ? CU_MEMORYTYPE_UNIFIED : CU_MEMORYTYPE_ARRAY, (const void *)(uintptr_t)sd, sd,
             dp ? CU_MEMORYTYPE_UNIFIED : CU_MEMORYTYPE_ARRAY, (const void *)(uintptr_t)dd, dd);
    return 0;
}

/* A batch call's copies into `b`; returns how many could not be sized. */
static uint64_t read_batch(uint8_t shape, const void *p, const gc_call *proto, struct batch *b)
{
    const CUmemorytype U = CU_MEMORYTYPE_UNIFIED;
    uint64_t unsized = 0;
    if (shape == S_BATCH || shape == S_BATCH1) {
        const CUdeviceptr *dsts, *srcs;
        const size_t *sizes;
        size_t n;
        if (shape == S_BATCH) {
            const struct p_batch *q = p;
            dsts = q->dsts, srcs = q->srcs, sizes = q->sizes, n = q->count;
        } else {
            const struct p_batch1 *q = p;
            dsts = q->dsts, srcs = q->srcs, sizes = q->sizes, n = q->count;
        }
        if (!dsts || !srcs || !sizes || n > BATCH_MAX_COPIES) return n ? n : 1;
        for (size_t i = 0; i < n; i++) {
            gc_call c = *proto;
            c.bytes = sizes[i];
            classify(&c, U, (const void *)(uintptr_t)srcs[i], srcs[i], U, (const void *)(uintptr_t)dsts[i], dsts[i]);
            batch_add(b, &c);
        }
        return 0;
    }
    const CUDA_MEMCPY3D_BATCH_OP *ops;
    size_t n;
    if (shape == S_BATCH3D) ops = ((const struct p_batch3d *)p)->ops, n = ((const struct p_batch3d *)p)->n;
    else if (shape == S_BATCH3D1) ops = ((const struct p_batch3d1 *)p)->ops, n = ((const struct p_batch3d1 *)p)->n;
    else ops = ((const struct p_attr3d *)p)->op, n = 1;
    if (!ops || n > BATCH_MAX_COPIES) return n ? n : 1;
    for (size_t i = 0; i < n; i++) {
        gc_call c = *proto;
        if (read_op(&ops[i], &c) != 0) unsized++;
        else batch_add(b, &c);
    }
    return unsized;
}

/* A call of g_table[e - 1] that succeeded, its parameters `p`, made on device `dev` (-1: unknown). */
static void note(uint8_t e, int per_thread, const void *p, int dev, uint32_t corr)
{
    uint8_t shape = g_table[e - 1].shape;
    if (g_table[e - 1].async) {
        CUstream s = stream_of(shape, p);
        if (!s && per_thread) s = CU_STREAM_PER_THREAD;
        if (gc_launches_capturing(s)) return;   /* a node of the graph being captured, not work */
    }
    gc_call c;
    memset(&c, 0, sizeof(c));
    c.dev = (uint8_t)dev;                     /* the calling context's; a peer copy names its sender */
    if (dev >= 0 && (shape == S_BATCH || shape == S_BATCH1 || shape == S_BATCH3D || shape == S_BATCH3D1 ||
                     shape == S_ATTR3D)) {
        struct batch b;
        b.n = 0;
        c.what = GC_CALL_COPY;
        c.corr = corr;
        c.t_ns = (uint64_t)((int64_t)gc_mono_ns() + g_gpu_minus_mono);
        uint64_t unsized = read_batch(shape, p, &c, &b);
        batch_flush(&b);
        if (unsized) atomic_fetch_add_explicit(&g_lost, unsized, memory_order_relaxed);
        return;
    }
    if (dev < 0 || read_call(shape, g_table[e - 1].elem, p, &c) != 0) {
        atomic_fetch_add_explicit(&g_lost, 1, memory_order_relaxed);
        return;
    }
    if (c.what != GC_CALL_GRAPH && c.bytes == 0) return;   /* no work */
    c.corr = corr;
    c.t_ns = (uint64_t)((int64_t)gc_mono_ns() + g_gpu_minus_mono);
    push(&c);
}

int gc_calls_index(const char *name)
{
    for (size_t i = 0; i < NTABLE; i++)
        if (strcmp(name, g_table[i].name) == 0) return (int)i;
    return -1;
}

void gc_calls_note(int index, int per_thread, const void *params, int dev, uint32_t corr)
{
    if (index < 0 || (size_t)index >= NTABLE || !params || !atomic_load_explicit(&g_counting, memory_order_relaxed))
        return;
    note((uint8_t)(index + 1), per_thread, params, dev, corr);
}

int gc_calls_pending(void)
{
    if (!atomic_load(&g_started)) return 0;
    uint64_t deq = atomic_load_explicit(&g_deq, memory_order_relaxed);
    return atomic_load_explicit(&g_q[deq & (QUEUE_CELLS - 1)].seq, memory_order_acquire) == deq + 1 ||
           atomic_load_explicit(&g_lost, memory_order_relaxed) != atomic_load_explicit(&f_lost, memory_order_relaxed);
}

void gc_calls_fold(gc_tally *t, gc_segment *seg)
{
    if (!atomic_load(&g_started) || !t || !seg) return;
    for (uint32_t n = 0; n < QUEUE_CELLS; n++) {   /* at most a queue's worth under the lock: never endless */
        uint64_t deq = atomic_load_explicit(&g_deq, memory_order_relaxed);
        struct cell *cell = &g_q[deq & (QUEUE_CELLS - 1)];
        if (atomic_load_explicit(&cell->seq, memory_order_acquire) != deq + 1) break; /* empty, or being written */
        gc_call c = cell->c;
        atomic_store_explicit(&cell->seq, deq + QUEUE_CELLS, memory_order_release);
        atomic_store_explicit(&g_deq, deq + 1, memory_order_relaxed);
        gc_graph_contents contents;
        int known = c.what == GC_CALL_GRAPH && gc_graphs_contents(c.corr, &contents) == 0;
        gc_tally_call(t, &c, known ? &contents : NULL);
    }
    uint64_t lost = atomic_load_explicit(&g_lost, memory_order_relaxed);
    seg->calls_lost += lost - atomic_load_explicit(&f_lost, memory_order_relaxed);
    atomic_store_explicit(&f_lost, lost, memory_order_relaxed);
}
