/*
 * tally.c - turn CUPTI activity records into census totals. Pure arithmetic: no CUDA, no I/O,
 * no locks (the caller serialises), no allocation after gc_tally_create. Tests feed it real
 * CUPTI record structs on a CPU.
 *
 * Only fields whose offsets are the same in every CUPTI 13.x record version are read (checked
 * below against the headers we build with), so one build reads records of any 13.x libcupti.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cupti.h>

#include "gpu_census.h"
#include "internal.h"

/* Offsets of the fields we read, as in CUPTI 13.0 (Kernel10, Memcpy6, Memset4) and 13.5
 * (Kernel13, Memcpy7, Memset5). A newer header that moved them fails the build here. */
#define SAME_OFFSET(T, f, off) _Static_assert(offsetof(T, f) == (off), #T "." #f " moved")
SAME_OFFSET(GC_KERNEL_T, start, 16);
SAME_OFFSET(GC_KERNEL_T, end, 24);
SAME_OFFSET(GC_KERNEL_T, deviceId, 40);
SAME_OFFSET(GC_KERNEL_T, correlationId, 92);
SAME_OFFSET(GC_MEMCPY_T, copyKind, 4);
SAME_OFFSET(GC_MEMCPY_T, srcKind, 5);
SAME_OFFSET(GC_MEMCPY_T, dstKind, 6);
SAME_OFFSET(GC_MEMCPY_T, bytes, 8);
SAME_OFFSET(GC_MEMCPY_T, start, 16);
SAME_OFFSET(GC_MEMCPY_T, end, 24);
SAME_OFFSET(GC_MEMCPY_T, deviceId, 32);
SAME_OFFSET(GC_MEMCPY_T, correlationId, 44);
SAME_OFFSET(CUpti_ActivityMemcpyPtoP4, bytes, 8);
SAME_OFFSET(CUpti_ActivityMemcpyPtoP4, srcDeviceId, 44);
SAME_OFFSET(CUpti_ActivityMemcpyPtoP4, dstDeviceId, 52);
SAME_OFFSET(CUpti_ActivityMemcpyPtoP4, correlationId, 60);
SAME_OFFSET(GC_MEMSET_T, bytes, 8);
SAME_OFFSET(GC_MEMSET_T, deviceId, 32);
SAME_OFFSET(GC_MEMSET_T, correlationId, 44);
SAME_OFFSET(CUpti_ActivityUnifiedMemoryCounter3, counterKind, 4);
SAME_OFFSET(CUpti_ActivityUnifiedMemoryCounter3, value, 8);
SAME_OFFSET(CUpti_ActivityUnifiedMemoryCounter3, start, 16);
SAME_OFFSET(CUpti_ActivityUnifiedMemoryCounter3, end, 24);
SAME_OFFSET(CUpti_ActivityUnifiedMemoryCounter3, srcId, 40);
SAME_OFFSET(CUpti_ActivityUnifiedMemoryCounter3, dstId, 44);
SAME_OFFSET(CUpti_ActivityExternalCorrelation, externalKind, 4);
SAME_OFFSET(CUpti_ActivityExternalCorrelation, externalId, 8);
SAME_OFFSET(CUpti_ActivityExternalCorrelation, correlationId, 16);

_Static_assert(sizeof(gc_stat) == 24, "gc_stat layout");
_Static_assert(sizeof(gc_device) % 8 == 0 && sizeof(gc_window) % 8 == 0 && sizeof(gc_step) % 8 == 0,
               "segment structs are multiples of 8 bytes");
_Static_assert((GC_WINDOW_SLOTS & (GC_WINDOW_SLOTS - 1)) == 0, "window ring is a power of two");
_Static_assert((GC_STEP_SLOTS & (GC_STEP_SLOTS - 1)) == 0, "step ring is a power of two");
_Static_assert(offsetof(gc_segment, seq) % 8 == 0, "seq is 8-byte aligned");

/* Busy time is the union of kernel intervals per device. Records arrive out of order (streams,
 * per-thread buffers), so recent intervals stay open in a small sorted frontier and are committed
 * once they are older than GC_REORDER_NS behind the newest end seen, or when the frontier is full.
 * An interval arriving before the commit watermark is clipped to it, so nothing counts twice. */
#define GC_FRONTIER 256
#define GC_REORDER_NS 2000000000ull
#define GC_CORR_SLOTS 65536u /* launches remembered for step attribution; power of two */

struct interval { uint64_t s, e; };

struct frontier {
    struct interval iv[GC_FRONTIER + 1];
    uint32_t n;
    uint64_t committed;
    uint64_t watermark;
    uint64_t max_end;
};

struct corr_entry { uint32_t corr; uint32_t valid; uint64_t ext; };

struct gc_tally {
    gc_segment *seg;
    struct frontier fr[GC_MAX_DEVICES];
    struct corr_entry corr[GC_CORR_SLOTS];
    int ext_seen;               /* an EXTERNAL_CORRELATION record of ours arrived */
};

gc_tally *gc_tally_create(gc_segment *seg)
{
    gc_tally *t = calloc(1, sizeof(*t));
    if (t) t->seg = seg;
    return t;
}

void gc_tally_destroy(gc_tally *t) { free(t); }

static void commit_oldest(struct frontier *f)
{
    f->committed += f->iv[0].e - f->iv[0].s;
    f->watermark = f->iv[0].e;
    memmove(&f->iv[0], &f->iv[1], (f->n - 1) * sizeof(f->iv[0]));
    f->n--;
}

static void frontier_add(struct frontier *f, uint64_t s, uint64_t e)
{
    if (e <= s) return;
    if (s < f->watermark) {
        if (e <= f->watermark) return;
        s = f->watermark;
    }
    if (e > f->max_end) f->max_end = e;
    /* Intervals are disjoint and sorted by start (so by end too). New ones usually land last. */
    uint32_t hi = f->n;
    while (hi > 0 && f->iv[hi - 1].s > e) hi--;      /* [hi, n) start after e */
    uint32_t lo = hi;
    while (lo > 0 && f->iv[lo - 1].e >= s) lo--;     /* [lo, hi) overlap or touch [s, e) */
    if (lo < hi) {
        if (f->iv[lo].s < s) s = f->iv[lo].s;
        if (f->iv[hi - 1].e > e) e = f->iv[hi - 1].e;
    }
    memmove(&f->iv[lo + 1], &f->iv[hi], (f->n - hi) * sizeof(f->iv[0]));
    f->iv[lo].s = s;
    f->iv[lo].e = e;
    f->n = f->n - (hi - lo) + 1;
    if (f->n > GC_FRONTIER) commit_oldest(f);
}

static uint64_t frontier_busy(struct frontier *f, int final)
{
    while (f->n > 0 && (final || f->iv[0].e + GC_REORDER_NS < f->max_end)) commit_oldest(f);
    uint64_t busy = f->committed;
    for (uint32_t i = 0; i < f->n; i++) busy += f->iv[i].e - f->iv[i].s;
    return busy;
}

static inline void stat_add(gc_stat *st, uint64_t bytes, uint64_t ns)
{
    st->count++;
    st->bytes += bytes;
    st->ns += ns;
}

static inline void stat_add_n(gc_stat *st, uint64_t n, uint64_t bytes, uint64_t ns)
{
    st->count += n;
    st->bytes += bytes;
    st->ns += ns;
}

static inline uint64_t dur(uint64_t s, uint64_t e) { return e > s ? e - s : 0; }

static gc_device *device(gc_tally *t, uint32_t id)
{
    if (id >= GC_MAX_DEVICES) return NULL;
    gc_device *d = &t->seg->devices[id];
    if (!d->in_use) {
        d->in_use = 1;
        d->device_id = id;
    }
    return d;
}

static void seen(gc_tally *t, gc_device *d, uint64_t s, uint64_t e)
{
    if (s && (d->first_ns == 0 || s < d->first_ns)) d->first_ns = s;
    if (e > d->last_ns) d->last_ns = e;
    if (e > t->seg->last_gpu_ns) t->seg->last_gpu_ns = e;
}

/* The bucket slot for `idx`, reset if it held an older bucket; NULL if it holds a newer one. */
static gc_window *window_slot(gc_tally *t, uint64_t idx)
{
    gc_window *w = &t->seg->windows[idx & (GC_WINDOW_SLOTS - 1)];
    if (w->index == idx) return w;
    if (idx < w->index) return NULL;
    memset(w, 0, sizeof(*w));
    w->index = idx;
    return w;
}

/* W_EAGER: an eager kernel's record (a W_KERNEL that also fills eager_traced; under DEFAULT its count
 * came from the calls already). */
enum what { W_KERNEL, W_COPY, W_MEMSET, W_EAGER };

/* The default collector counts eager launches at their calls (gc_tally_launches_*): its kernel records are a sample. */
static int counted(const gc_tally *t) { return t->seg->collector == GC_COLLECTOR_DEFAULT; }

/* `n` pieces of work (a graph launch's kernels or copies of one kind) that began at s; the time from
 * s to e is split over the buckets it spans. */
static void window_add(gc_tally *t, enum what what, int dir, uint32_t dev, uint64_t s, uint64_t e,
                       uint64_t n, uint64_t bytes)
{
    if (s == 0) return;
    uint64_t idx = s / GC_WINDOW_NS;
    gc_window *w = window_slot(t, idx);
    if (!w) {
        t->seg->window_late++;
        t->seg->flags |= GC_FLAG_RING_OVERRUN;
        return;
    }
    w->device_mask |= 1ull << (dev & 63);
    /* Counts and bytes belong to the start bucket; time is split over the buckets it spans. */
    uint64_t first_ns = dur(s, e);
    if (e > (idx + 1) * GC_WINDOW_NS) first_ns = (idx + 1) * GC_WINDOW_NS - s;
    switch (what) {
    case W_KERNEL: w->kernel_count += n; w->kernel_ns += first_ns; break;
    case W_EAGER:
        if (!counted(t)) w->kernel_count += n;
        w->kernel_ns += first_ns;
        w->eager_traced += n;
        w->eager_traced_ns += first_ns;
        break;
    case W_COPY: stat_add_n(&w->copy[dir], n, bytes, first_ns); break;
    case W_MEMSET: stat_add_n(&w->memset, n, bytes, first_ns); break;
    }
    uint64_t last = e ? (e - 1) / GC_WINDOW_NS : idx;
    if (last > idx + GC_WINDOW_SLOTS) last = idx + GC_WINDOW_SLOTS; /* bounded work per record */
    for (uint64_t b = idx + 1; b <= last; b++) {
        gc_window *x = window_slot(t, b);
        if (!x) continue;
        uint64_t lo = b * GC_WINDOW_NS, hi = lo + GC_WINDOW_NS;
        uint64_t part = (e < hi ? e : hi) - lo;
        x->device_mask |= 1ull << (dev & 63);
        switch (what) {
        case W_KERNEL: x->kernel_ns += part; break;
        case W_EAGER: x->kernel_ns += part; x->eager_traced_ns += part; break;
        case W_COPY: x->copy[dir].ns += part; break;
        case W_MEMSET: x->memset.ns += part; break;
        }
    }
}

/* Step `id`'s slot, reset if it held an older step; NULL when a newer step holds it already. */
static gc_step *step_slot(gc_tally *t, uint64_t id)
{
    gc_step *st = &t->seg->steps[id & (GC_STEP_SLOTS - 1)];
    if (st->id != id) {
        if (id < st->id) {
            t->seg->flags |= GC_FLAG_RING_OVERRUN;
            return NULL;
        }
        memset(st, 0, sizeof(*st));
        st->id = id;
    }
    return st;
}

/* The step that launched correlation id `corr`: from an EXTERNAL_CORRELATION record (a CUPTI that
 * emits them, or a test), else from the launch table the API callbacks fill (steps.c). */
static gc_step *step_for(gc_tally *t, uint32_t corr)
{
    struct corr_entry *c = &t->corr[corr & (GC_CORR_SLOTS - 1)];
    uint64_t id = c->valid && c->corr == corr ? c->ext : gc_steps_lookup(corr);
    if (id > t->seg->step_max) t->seg->step_max = id; /* records of it have come: the settler waits on this */
    return id ? step_slot(t, id) : NULL;
}

static void step_add(gc_tally *t, enum what what, int dir, uint32_t dev, uint32_t corr,
                     uint64_t s, uint64_t e, uint64_t n, uint64_t bytes)
{
    if (!t->ext_seen && !gc_steps_in_use()) return; /* no step was ever begun: nothing to attribute */
    gc_step *st = step_for(t, corr);
    if (!st) {
        t->seg->step_unmatched++;
        return;
    }
    st->device_mask |= 1ull << (dev & 63);
    if (s && (st->first_ns == 0 || s < st->first_ns)) st->first_ns = s;
    if (e > st->last_ns) st->last_ns = e;
    switch (what) {
    case W_KERNEL: st->kernel_count += n; st->kernel_ns += dur(s, e); break;
    case W_EAGER:
        if (!counted(t)) st->kernel_count += n;
        st->kernel_ns += dur(s, e);
        st->eager_traced += n;
        st->eager_traced_ns += dur(s, e);
        break;
    case W_COPY: stat_add_n(&st->copy[dir], n, bytes, dur(s, e)); break;
    case W_MEMSET: stat_add_n(&st->memset, n, bytes, dur(s, e)); break;
    }
}

static int copy_dir(uint8_t kind)
{
    switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOA: return GC_DIR_HTOD;
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOH: return GC_DIR_DTOH;
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOA:
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOD:
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOA: return GC_DIR_DTOD;
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return GC_DIR_PTOP;
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return GC_DIR_HTOH;
    default: return GC_DIR_OTHER;
    }
}

static int mem_kind(uint8_t k)
{
    switch (k) {
    case CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE: return GC_MEM_PAGEABLE;
    case CUPTI_ACTIVITY_MEMORY_KIND_PINNED: return GC_MEM_PINNED;
    case CUPTI_ACTIVITY_MEMORY_KIND_DEVICE:
    case CUPTI_ACTIVITY_MEMORY_KIND_ARRAY:
    case CUPTI_ACTIVITY_MEMORY_KIND_DEVICE_STATIC: return GC_MEM_DEVICE;
    default: return GC_MEM_OTHER;
    }
}

/* The host side decides pageable vs pinned; device-only copies are DEVICE. */
static int host_side(int dir, uint8_t src, uint8_t dst)
{
    switch (dir) {
    case GC_DIR_HTOD:
    case GC_DIR_HTOH: return mem_kind(src);
    case GC_DIR_DTOH: return mem_kind(dst);
    case GC_DIR_DTOD:
    case GC_DIR_PTOP: return GC_MEM_DEVICE;
    default: {
        int m = mem_kind(src);
        return m == GC_MEM_DEVICE ? mem_kind(dst) : m;
    }
    }
}

/* One eager kernel's duration: the device's and its window's sample (not its count: DEFAULT counts launches). */
static void eager_time(gc_tally *t, gc_device *d, uint32_t dev, uint64_t s, uint64_t e)
{
    d->kernel_ns += dur(s, e);
    d->eager_traced++;
    d->eager_traced_ns += dur(s, e);
    window_add(t, W_EAGER, 0, dev, s, e, 1, 0);
}

/* ... and, a record of where it ran on the GPU, busy too. */
static void eager_sample(gc_tally *t, gc_device *d, uint32_t dev, uint64_t s, uint64_t e)
{
    eager_time(t, d, dev, s, e);
    seen(t, d, s, e);
    frontier_add(&t->fr[dev], s, e);
}

static void tally_kernel(gc_tally *t, const GC_KERNEL_T *k)
{
    gc_device *d = device(t, k->deviceId);
    if (!d) { t->seg->records_unknown++; return; }
    if (!counted(t)) d->kernel_count++;
    eager_sample(t, d, k->deviceId, k->start, k->end);
    step_add(t, W_EAGER, 0, k->deviceId, k->correlationId, k->start, k->end, 1, 0);
}

/* `n` copies of `bytes` together (a record is one; a batch call's copies of one class are several) */
static void tally_copies(gc_tally *t, uint32_t dev, int dir, int mem, uint32_t corr,
                         uint64_t s, uint64_t e, uint64_t n, uint64_t bytes)
{
    gc_device *d = device(t, dev);
    if (!d) { t->seg->records_unknown++; return; }
    stat_add_n(&d->copy[dir][mem], n, bytes, dur(s, e));
    seen(t, d, s, e);
    window_add(t, W_COPY, dir, dev, s, e, n, bytes);
    step_add(t, W_COPY, dir, dev, corr, s, e, n, bytes);
}

static void tally_copy(gc_tally *t, uint32_t dev, int dir, int mem, uint32_t corr,
                       uint64_t s, uint64_t e, uint64_t bytes)
{
    tally_copies(t, dev, dir, mem, corr, s, e, 1, bytes);
}

static void tally_memcpy(gc_tally *t, const GC_MEMCPY_T *m)
{
    int dir = copy_dir(m->copyKind);
    tally_copy(t, m->deviceId, dir, host_side(dir, m->srcKind, m->dstKind), m->correlationId,
               m->start, m->end, m->bytes);
}

/* Peer copies: counted as sent by the source device, and as received by the destination. */
static void tally_peer_copies(gc_tally *t, uint32_t src, uint32_t dst, uint32_t corr, uint64_t s, uint64_t e,
                              uint64_t n, uint64_t bytes)
{
    tally_copies(t, src, GC_DIR_PTOP, GC_MEM_DEVICE, corr, s, e, n, bytes);
    gc_device *d = device(t, dst);
    if (d) stat_add_n(&d->peer_recv, n, bytes, dur(s, e));
}

static void tally_peer(gc_tally *t, const CUpti_ActivityMemcpyPtoP4 *p)
{
    tally_peer_copies(t, p->srcDeviceId, p->dstDeviceId, p->correlationId, p->start, p->end, 1, p->bytes);
}

static void tally_set(gc_tally *t, uint32_t dev, uint32_t corr, uint64_t s, uint64_t e, uint64_t bytes)
{
    gc_device *d = device(t, dev);
    if (!d) { t->seg->records_unknown++; return; }
    stat_add(&d->memset, bytes, dur(s, e));
    seen(t, d, s, e);
    window_add(t, W_MEMSET, 0, dev, s, e, 1, bytes);
    step_add(t, W_MEMSET, 0, dev, corr, s, e, 1, bytes);
}

static void tally_memset(gc_tally *t, const GC_MEMSET_T *m)
{
    tally_set(t, m->deviceId, m->correlationId, m->start, m->end, m->bytes);
}

/* One record per graph launch (GRAPH_TRACE), with what the launch put on the GPU as graphs.c learned
 * it. Copies and memsets count exactly, always (their own durations are not known: 0 ns); kernels
 * count by node, and their time, the busy union and the windows take the graph's span, like a kernel
 * record that covers the graph. Unknown contents: only the span. */
/* `busy`: the span was measured (a record), so it joins the busy union; an estimated span (a launch counted at
 * its call and priced at its exec's mean) does not. */
static void graph_launch(gc_tally *t, const CUpti_ActivityGraphTrace2 *g, const gc_graph_contents *c, int busy)
{
    gc_device *d = device(t, g->deviceId);
    if (!d) { t->seg->records_unknown++; return; }
    t->seg->flags |= GC_FLAG_GRAPH_LAUNCHES;
    d->graph_launches++;
    d->graph_ns += dur(g->start, g->end);
    seen(t, d, g->start, g->end);
    if (!c) {
        t->seg->graph_unknown++;
        t->seg->flags |= GC_FLAG_GRAPH_INEXACT;
    } else {
        if (c->flags & GC_GRAPH_INEXACT) {
            t->seg->graph_inexact++;
            t->seg->flags |= GC_FLAG_GRAPH_INEXACT;
        }
        for (int dir = 0; dir < GC_NDIR; dir++)
            for (int mem = 0; mem < GC_NMEM; mem++) {
                uint64_t n = c->copies[dir][mem], bytes = c->copy_bytes[dir][mem];
                if (!n) continue;
                stat_add_n(&d->copy[dir][mem], n, bytes, 0);
                window_add(t, W_COPY, dir, g->deviceId, g->start, g->start, n, bytes);
                step_add(t, W_COPY, dir, g->deviceId, g->correlationId, g->start, g->start, n, bytes);
            }
        if (c->memsets) {
            stat_add_n(&d->memset, c->memsets, c->memset_bytes, 0);
            window_add(t, W_MEMSET, 0, g->deviceId, g->start, g->start, c->memsets, c->memset_bytes);
            step_add(t, W_MEMSET, 0, g->deviceId, g->correlationId, g->start, g->start, c->memsets, c->memset_bytes);
        }
        if (!c->kernels) return; /* a graph of copies alone: no kernel time */
    }
    uint64_t k = c ? c->kernels : 0;
    d->kernel_count += k;
    d->graph_kernel_count += k;
    d->kernel_ns += dur(g->start, g->end);
    if (busy) frontier_add(&t->fr[g->deviceId], g->start, g->end);
    window_add(t, W_KERNEL, 0, g->deviceId, g->start, g->end, k, 0);
    step_add(t, W_KERNEL, 0, g->deviceId, g->correlationId, g->start, g->end, k, 0);
}

void gc_tally_call(gc_tally *t, const gc_call *c, const gc_graph_contents *contents)
{
    uint64_t copies = c->copies ? c->copies : 1;
    if (c->what == GC_CALL_GRAPH) {
        CUpti_ActivityGraphTrace2 g;
        memset(&g, 0, sizeof(g));
        g.kind = CUPTI_ACTIVITY_KIND_GRAPH_TRACE;
        g.start = g.end = c->t_ns;
        g.deviceId = c->dev;
        g.correlationId = c->corr;
        /* timing on: the mean span its exec's timed launches had, placed from the call on */
        if (contents && contents->span_from != GC_SPAN_NONE) g.end = g.start + contents->span_ns;
        else if (t->seg->timing.on && (!contents || contents->kernels)) t->seg->graph_untimed++;
        graph_launch(t, &g, contents, 0);
        return;
    }
    if (c->what == GC_CALL_MEMSET) tally_set(t, c->dev, c->corr, c->t_ns, c->t_ns, c->bytes);
    else if (c->what != GC_CALL_COPY || c->dir >= GC_NDIR || c->mem >= GC_NMEM) t->seg->records_unknown++;
    else if (c->dir == GC_DIR_PTOP) tally_peer_copies(t, c->dev, c->peer_dev, c->corr, c->t_ns, c->t_ns, copies, c->bytes);
    else tally_copies(t, c->dev, c->dir, c->mem, c->corr, c->t_ns, c->t_ns, copies, c->bytes);
}

void gc_tally_graph_launch(gc_tally *t, const void *record, const gc_graph_contents *c)
{
    graph_launch(t, record, c, 1);
}

void gc_tally_eager_sample(gc_tally *t, uint32_t dev, uint64_t t_ns, uint64_t ns)
{
    gc_device *d = device(t, dev);
    if (!d) { t->seg->records_unknown++; return; }
    eager_time(t, d, dev, t_ns, t_ns + ns);
}

static void tally_graph(gc_tally *t, const CUpti_ActivityGraphTrace2 *g)
{
    gc_graph_contents c;
    gc_tally_graph_launch(t, g, gc_graphs_contents(g->correlationId, &c) == 0 ? &c : NULL);
}

static void tally_external(gc_tally *t, const CUpti_ActivityExternalCorrelation *x)
{
    if (x->externalKind != GC_EXTERNAL_KIND) return;
    struct corr_entry *c = &t->corr[x->correlationId & (GC_CORR_SLOTS - 1)];
    c->corr = x->correlationId;
    c->ext = x->externalId;
    c->valid = 1;
    t->ext_seen = 1;
    if (x->externalId > t->seg->step_max) t->seg->step_max = x->externalId;
}

/* A migration of managed memory (no correlation id: in the device's totals and the windows, never in a step). */
static void migrated(gc_tally *t, uint32_t dev, int dir, uint64_t s, uint64_t e, uint64_t bytes)
{
    gc_device *d = device(t, dev);
    if (!d) { t->seg->records_unknown++; return; }
    stat_add(&d->copy[dir][GC_MEM_OTHER], bytes, dur(s, e));
    seen(t, d, s, e);
    window_add(t, W_COPY, dir, dev, s, e, 1, bytes);
}

/* One of CUPTI's unified-memory counter records: bytes migrated each way, faults, thrashing and the like. */
static void tally_um(gc_tally *t, const CUpti_ActivityUnifiedMemoryCounter3 *u)
{
    gc_device *d = NULL;
    t->seg->flags |= GC_FLAG_MANAGED;
    switch (u->counterKind) {
    case CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_HTOD:
        migrated(t, u->dstId, GC_DIR_MANAGED_HTOD, u->start, u->end, u->value);
        return;
    case CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_DTOH:
        migrated(t, u->srcId, GC_DIR_MANAGED_DTOH, u->start, u->end, u->value);
        return;
    case CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_DTOD:
        if ((d = device(t, u->dstId))) stat_add(&d->managed.migrated_dtod, u->value, dur(u->start, u->end));
        break;
    case CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_CPU_PAGE_FAULT_COUNT: t->seg->um_cpu_faults++; return;
    case CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_GPU_PAGE_FAULT:
        if ((d = device(t, u->srcId))) d->managed.gpu_faults += u->value ? u->value : 1;
        break;
    case CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_THRASHING:   /* srcId: the devices fighting over the pages */
        for (uint32_t i = 0; i < 32 && i < GC_MAX_DEVICES; i++)
            if ((u->srcId >> i & 1u) && (d = device(t, i))) d->managed.thrashing++;
        return;
    case CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_THROTTLING:
        if ((d = device(t, u->srcId))) d->managed.throttling++;
        break;
    case CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_REMOTE_MAP:
        if ((d = device(t, u->dstId))) d->managed.remote_maps++;
        break;
    default: t->seg->records_unknown++; return;
    }
    if (!d) t->seg->records_unknown++;
}

void gc_tally_record(gc_tally *t, const void *record)
{
    const CUpti_Activity *r = record;
    t->seg->records++;
    switch (r->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: tally_kernel(t, record); break;
    case CUPTI_ACTIVITY_KIND_MEMCPY: tally_memcpy(t, record); break;
    case CUPTI_ACTIVITY_KIND_MEMCPY2: tally_peer(t, record); break;
    case CUPTI_ACTIVITY_KIND_MEMSET: tally_memset(t, record); break;
    case CUPTI_ACTIVITY_KIND_GRAPH_TRACE: tally_graph(t, record); break;
    case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: tally_external(t, record); break;
    case CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER: tally_um(t, record); break;
    default: t->seg->records_unknown++; break;
    }
}

/* Launches the callbacks counted (launches.c), folded in under the writer's lock. */
void gc_tally_launches_device(gc_tally *t, uint32_t dev, uint64_t n)
{
    gc_device *d = device(t, dev);
    if (!d) { t->seg->launches_lost += n; return; }
    d->eager_launches += n;
    if (counted(t)) d->kernel_count += n;
}

void gc_tally_launches_window(gc_tally *t, uint64_t gpu_ns, uint64_t n)
{
    gc_window *w = gpu_ns ? window_slot(t, gpu_ns / GC_WINDOW_NS) : NULL;
    if (!w) { /* in the totals, not in a window */
        t->seg->window_late++;
        t->seg->flags |= GC_FLAG_RING_OVERRUN;
        return;
    }
    w->eager_launches += n;
    if (counted(t)) w->kernel_count += n;
}

/* Not step_max: launches are folded at the step's end, its records come a flush or more later, and
 * the settler reads step_max as "this step's records are in" (else, on vLLM: requests served by steps
 * that had their launches and none of their records). */
void gc_tally_launches_step(gc_tally *t, uint64_t id, uint32_t dev, uint64_t n)
{
    gc_step *st = id && id <= UINT32_MAX ? step_slot(t, id) : NULL;
    if (!st) { t->seg->launches_lost += n; return; }
    st->device_mask |= 1ull << (dev & 63);
    st->eager_launches += n;
    if (counted(t)) st->kernel_count += n;
}

void gc_tally_publish(gc_tally *t, int final)
{
    for (uint32_t i = 0; i < GC_MAX_DEVICES; i++)
        if (t->seg->devices[i].in_use) t->seg->devices[i].busy_ns = frontier_busy(&t->fr[i], final);
}
