/*
 * graphs.c - what a CUDA graph launch puts on the GPU, learned once per graph instead of traced node
 * by node.
 *
 * CUPTI's per-node records cost every node of every replay, and copies alike: enabling only the MEMCPY
 * kind made graph replay as slow as tracing every kernel (measured). Its GRAPH_TRACE kind
 * costs one record per launch but says nothing of what ran. So when a graph is instantiated, or an exec
 * is updated from another graph, we walk the graph once: kernel nodes, memcpy nodes with their bytes,
 * direction and host memory kind, memset nodes, child graphs. That makes a "version" of the exec's
 * contents. Each launch notes "correlation id -> the version its exec had then" (a lock-free table,
 * like steps.c); the tally adds that version's contents for the launch's GRAPH_TRACE record. Kernel
 * and copy counts and bytes stay exact; a graph's kernel time is its span on the GPU.
 *
 * What cannot be exact is counted, never hidden: a conditional node (its body runs any number of
 * times), a node changed in the exec after instantiation (cuGraphExec*SetParams, cuGraphNodeSetEnabled),
 * a graph whose walk failed, a launch of an exec we never saw.
 *
 * Costs: the walk runs in the thread that instantiates or updates (never on a plain launch); a launch
 * pays one hash probe. Memory: at most GV_SLOTS versions (allocated at the first graph), bounded.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h>

#include "gpu_census.h"
#include "internal.h"

#define GV_SLOTS 4096u           /* versions of graph contents (power of two) */
#define GX_SLOTS 8192u           /* exec handle -> current version, open addressing (power of two) */
#define GX_PROBES 64u
#define GL_SLOTS (1u << 16)      /* correlation id -> version, direct-mapped (power of two) */
#define GT_SLOTS (1u << 14)      /* the same for event-timed launches (power of two) */
#define MAX_DEPTH 8
#define MAX_NODES (1u << 20)

struct version {
    _Atomic uint32_t n;          /* the version number this slot holds; 0: none */
    _Atomic uint32_t flags;      /* GC_GRAPH_INEXACT may be set later (a node changed in the exec) */
    gc_graph_contents c;
    /* the spans its event-timed launches had (the flusher adds, the fold reads) */
    _Atomic uint64_t span_ns;
    _Atomic uint64_t spans;
};

struct exec_slot {
    _Atomic uint64_t key;        /* the CUgraphExec; 0: never used */
    _Atomic uint32_t n;          /* its current version; 0: destroyed (a tombstone) or unknown */
    uint32_t pad;
};

static struct {
    struct version *v;           /* GV_SLOTS */
    struct exec_slot *x;         /* GX_SLOTS */
    _Atomic uint64_t *launch;    /* GL_SLOTS: (correlation id << 32) | version */
    _Atomic uint64_t *timed;     /* GT_SLOTS: the same for the launches an event pair times (events.c) */
    _Atomic uint64_t all_ns, all_kernels; /* every timed span, and the kernels of those launches */
    _Atomic uint32_t next;       /* the last version number handed out */
    pthread_mutex_t mu;          /* writers of the exec table */
    /* the driver's graph queries, from the libcuda already in the process */
    CUresult (*get_nodes)(CUgraph, CUgraphNode *, size_t *);
    CUresult (*node_type)(CUgraphNode, CUgraphNodeType *);
    CUresult (*memcpy_params)(CUgraphNode, CUDA_MEMCPY3D *);
    CUresult (*memset_params)(CUgraphNode, CUDA_MEMSET_NODE_PARAMS *);
    CUresult (*child_graph)(CUgraphNode, CUgraph *);
} g = {.mu = PTHREAD_MUTEX_INITIALIZER};

static atomic_int g_on;

/* ---- the walk ---- */

static void add_memcpy(gc_graph_contents *c, const CUDA_MEMCPY3D *m)
{
    int dir, mem, peer;
    gc_copy_class(m->srcMemoryType, m->srcHost, m->srcDevice, m->dstMemoryType, m->dstHost, m->dstDevice,
                  &dir, &mem, &peer);
    size_t h = m->Height ? m->Height : 1, d = m->Depth ? m->Depth : 1;
    c->copies[dir][mem]++;
    c->copy_bytes[dir][mem] += (uint64_t)m->WidthInBytes * h * d;
}

/* 0, or -1 when the graph could not be read (the contents are then unknown). */
static int walk(CUgraph graph, gc_graph_contents *c, int depth)
{
    size_t n = 0;
    if (depth > MAX_DEPTH || g.get_nodes(graph, NULL, &n) != CUDA_SUCCESS || n > MAX_NODES) return -1;
    if (n == 0) return 0;
    CUgraphNode *nodes = malloc(n * sizeof(*nodes));
    if (!nodes) return -1;
    size_t got = n;
    int rc = g.get_nodes(graph, nodes, &got) == CUDA_SUCCESS ? 0 : -1;
    for (size_t i = 0; rc == 0 && i < got && i < n; i++) {
        CUgraphNodeType t;
        if (g.node_type(nodes[i], &t) != CUDA_SUCCESS) { rc = -1; break; }
        switch (t) {
        case CU_GRAPH_NODE_TYPE_KERNEL: c->kernels++; break;
        case CU_GRAPH_NODE_TYPE_MEMCPY: {
            CUDA_MEMCPY3D m;
            memset(&m, 0, sizeof(m));
            if (g.memcpy_params(nodes[i], &m) != CUDA_SUCCESS) { rc = -1; break; }
            add_memcpy(c, &m);
            break;
        }
        case CU_GRAPH_NODE_TYPE_MEMSET: {
            CUDA_MEMSET_NODE_PARAMS m;
            memset(&m, 0, sizeof(m));
            if (g.memset_params(nodes[i], &m) != CUDA_SUCCESS) { rc = -1; break; }
            c->memsets++;
            c->memset_bytes += (uint64_t)m.elementSize * m.width * (m.height ? m.height : 1);
            break;
        }
        case CU_GRAPH_NODE_TYPE_GRAPH: {
            CUgraph child;
            if (g.child_graph(nodes[i], &child) != CUDA_SUCCESS) { rc = -1; break; }
            rc = walk(child, c, depth + 1);
            break;
        }
        case CU_GRAPH_NODE_TYPE_CONDITIONAL: c->flags |= GC_GRAPH_INEXACT; break;
        default: break; /* host, event, wait, allocation, empty nodes: no GPU work of ours to count */
        }
    }
    free(nodes);
    return rc;
}

/* ---- versions and the exec table ---- */

static uint32_t publish_version(const gc_graph_contents *c)
{
    uint32_t n = atomic_fetch_add(&g.next, 1) + 1;
    if (n == 0) n = atomic_fetch_add(&g.next, 1) + 1; /* 0 means "none" */
    struct version *v = &g.v[n & (GV_SLOTS - 1)];
    atomic_store_explicit(&v->n, 0, memory_order_relaxed); /* readers of the old version see it go */
    atomic_thread_fence(memory_order_release);
    v->c = *c;
    atomic_store_explicit(&v->span_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&v->spans, 0, memory_order_relaxed);
    atomic_store_explicit(&v->flags, c->flags, memory_order_relaxed);
    atomic_store_explicit(&v->n, n, memory_order_release);
    return n;
}

static inline uint32_t hash_exec(uint64_t k) { return (uint32_t)((k >> 4) * 0x9E3779B97F4A7C15ull >> 40); }

/* The exec's current version (0: unknown). Lock-free: launches call it. */
static uint32_t exec_version(uint64_t key)
{
    uint32_t h = hash_exec(key);
    for (uint32_t i = 0; i < GX_PROBES; i++) {
        struct exec_slot *s = &g.x[(h + i) & (GX_SLOTS - 1)];
        uint64_t k = atomic_load_explicit(&s->key, memory_order_acquire);
        if (k == key) return atomic_load_explicit(&s->n, memory_order_acquire);
        if (k == 0) return 0;
    }
    return 0;
}

/* Set the exec's current version (n = 0: destroyed). Writers hold g.mu. A tombstone (n = 0) is
 * reused by the next new exec along its probe path, so the table never fills with dead execs. */
static void exec_set(uint64_t key, uint32_t n)
{
    uint32_t h = hash_exec(key);
    struct exec_slot *tomb = NULL;
    pthread_mutex_lock(&g.mu);
    for (uint32_t i = 0; i < GX_PROBES; i++) {
        struct exec_slot *s = &g.x[(h + i) & (GX_SLOTS - 1)];
        uint64_t k = atomic_load_explicit(&s->key, memory_order_relaxed);
        if (k == key) {
            atomic_store_explicit(&s->n, n, memory_order_release);
            goto out;
        }
        if (k != 0 && !tomb && atomic_load_explicit(&s->n, memory_order_relaxed) == 0) tomb = s;
        if (k == 0) {
            if (!tomb) tomb = s;
            break;
        }
    }
    if (n && tomb) {
        atomic_store_explicit(&tomb->n, 0, memory_order_relaxed);
        atomic_store_explicit(&tomb->key, key, memory_order_release);
        atomic_store_explicit(&tomb->n, n, memory_order_release);
    } else if (n) {
        static int said; /* under g.mu */
        if (!said && (said = 1))
            gc_log("graphs: more than %u live CUDA graphs; launches of the others count as unknown", GX_SLOTS);
    }
out:
    pthread_mutex_unlock(&g.mu);
}

static void learn(CUgraphExec exec, CUgraph graph)
{
    gc_graph_contents c;
    memset(&c, 0, sizeof(c));
    if (walk(graph, &c, 0) != 0) {
        exec_set((uint64_t)(uintptr_t)exec, 0); /* unknown: its launches say so */
        return;
    }
    /* An update that changed nothing we count (llama.cpp updates its graph every token) keeps its
     * version: fewer versions, and records of earlier launches stay readable for longer. */
    uint32_t cur = exec_version((uint64_t)(uintptr_t)exec);
    if (cur) {
        struct version *v = &g.v[cur & (GV_SLOTS - 1)];
        if (atomic_load_explicit(&v->n, memory_order_acquire) == cur &&
            !(atomic_load_explicit(&v->flags, memory_order_relaxed) & GC_GRAPH_INEXACT) &&
            memcmp(&v->c, &c, sizeof(c)) == 0)
            return;
    }
    exec_set((uint64_t)(uintptr_t)exec, publish_version(&c));
}

static void mark_changed(CUgraphExec exec)
{
    uint32_t n = exec_version((uint64_t)(uintptr_t)exec);
    struct version *v = n ? &g.v[n & (GV_SLOTS - 1)] : NULL;
    if (v && atomic_load_explicit(&v->n, memory_order_acquire) == n)
        atomic_fetch_or_explicit(&v->flags, GC_GRAPH_INEXACT, memory_order_relaxed);
}

/* A launch of `exec` under correlation id `corr`, noted in `table` (`slots` a power of two): its contents as of
 * now. g.launch for the tally (our ids or CUPTI's), g.timed for the launches event pairs time. */
static void note_in(_Atomic uint64_t *table, uint32_t slots, CUgraphExec exec, uint32_t corr)
{
    uint32_t n = exec_version((uint64_t)(uintptr_t)exec);
    atomic_store_explicit(&table[corr & (slots - 1)], ((uint64_t)corr << 32) | n, memory_order_release);
}

static void note_launch(CUgraphExec exec, uint32_t corr) { note_in(g.launch, GL_SLOTS, exec, corr); }

/* The version noted for `corr` in `table`, still held by its slot; NULL (and *n 0) when none. */
static struct version *noted(_Atomic uint64_t *table, uint32_t slots, uint32_t corr, uint32_t *n)
{
    uint64_t e = atomic_load_explicit(&table[corr & (slots - 1)], memory_order_acquire);
    *n = (uint32_t)e;
    if ((uint32_t)(e >> 32) != corr || *n == 0) return NULL;
    struct version *v = &g.v[*n & (GV_SLOTS - 1)];
    return atomic_load_explicit(&v->n, memory_order_acquire) == *n ? v : NULL;
}

/* ---- what tells us of graphs: the preloaded wrappers (interpose.c) or CUPTI's callbacks (graph_callbacks.c) ---- */

void gc_graphs_learn(CUgraphExec exec, CUgraph graph)
{
    if (atomic_load_explicit(&g_on, memory_order_acquire) && exec) learn(exec, graph);
}

void gc_graphs_forget(CUgraphExec exec)
{
    if (atomic_load_explicit(&g_on, memory_order_acquire) && exec) exec_set((uint64_t)(uintptr_t)exec, 0);
}

void gc_graphs_changed(CUgraphExec exec)
{
    if (atomic_load_explicit(&g_on, memory_order_acquire)) mark_changed(exec);
}

void gc_graphs_launch(CUgraphExec exec, uint32_t corr)
{
    if (atomic_load_explicit(&g_on, memory_order_acquire)) note_launch(exec, corr);
}

/* ---- spans measured by event pairs (events.c) ---- */

/* A graph launch an event pair times: its correlation id -> the exec's version now. */
void gc_graphs_timed_launch(CUgraphExec exec, uint32_t corr)
{
    if (atomic_load_explicit(&g_on, memory_order_acquire) && g.timed) note_in(g.timed, GT_SLOTS, exec, corr);
}

/* That pair's reading: the launch's span joins the version's mean (and the all-graphs one). */
void gc_graphs_timed_span(uint32_t corr, uint64_t ns)
{
    uint32_t n;
    struct version *v = g.timed && ns ? noted(g.timed, GT_SLOTS, corr, &n) : NULL;
    if (!v || !v->c.kernels) return;
    atomic_fetch_add_explicit(&v->span_ns, ns, memory_order_relaxed);
    atomic_fetch_add_explicit(&v->spans, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&g.all_ns, ns, memory_order_relaxed);
    atomic_fetch_add_explicit(&g.all_kernels, v->c.kernels, memory_order_relaxed);
}

/* Whether `exec`'s current version has fewer than `min` spans in its mean: its launches are then timed whatever the
 * sample says, so that every exec a server launches often gets a measured span of its own. Lock-free: launches ask. */
int gc_graphs_span_wanted(CUgraphExec exec, uint32_t min)
{
    if (!atomic_load_explicit(&g_on, memory_order_acquire) || !g.x) return 0;
    uint32_t n = exec_version((uint64_t)(uintptr_t)exec);
    if (!n) return 0;
    struct version *v = &g.v[n & (GV_SLOTS - 1)];
    return atomic_load_explicit(&v->n, memory_order_acquire) == n &&
           atomic_load_explicit(&v->spans, memory_order_relaxed) < min;
}

/* The table of event-timed launches, made when the events start: 0, or -1 without memory. */
int gc_graphs_timed_start(void)
{
    if (g.timed) return 0;
    _Atomic uint64_t *p = calloc(GT_SLOTS, sizeof(*p));
    if (!p) return -1;
    g.timed = p;
    return 0;
}

/* A launch's estimated span: its version's mean, else every timed graph's time per kernel node x its kernels. */
static void span_of(const struct version *v, gc_graph_contents *out)
{
    uint64_t ns = atomic_load_explicit(&v->span_ns, memory_order_relaxed);
    uint64_t k = atomic_load_explicit(&v->spans, memory_order_relaxed);
    uint64_t all = atomic_load_explicit(&g.all_ns, memory_order_relaxed);
    uint64_t all_k = atomic_load_explicit(&g.all_kernels, memory_order_relaxed);
    out->span_from = GC_SPAN_NONE;
    out->span_ns = 0;
    if (k) {
        out->span_from = GC_SPAN_EXEC;
        out->span_ns = (ns + k / 2) / k;
    } else if (all_k && out->kernels) {
        out->span_from = GC_SPAN_ALL;
        out->span_ns = (uint64_t)((unsigned __int128)all * out->kernels / all_k);
    }
}

int gc_graphs_contents(uint32_t corr, gc_graph_contents *out)
{
    uint32_t n;
    struct version *v = g.launch ? noted(g.launch, GL_SLOTS, corr, &n) : NULL;
    if (!v) return -1;
    *out = v->c;
    uint32_t flags = atomic_load_explicit(&v->flags, memory_order_relaxed);
    span_of(v, out);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&v->n, memory_order_relaxed) != n) return -1; /* reused while copied */
    out->flags |= flags;
    return 0;
}

int gc_graphs_start(void)
{
    if (atomic_load(&g_on)) return 0;   /* the default collector started it before falling back */
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!cuda) return -1;
#define SYM(field, name) (*(void **)&g.field = dlsym(cuda, name))
    SYM(get_nodes, "cuGraphGetNodes");
    SYM(node_type, "cuGraphNodeGetType");
    SYM(memcpy_params, "cuGraphMemcpyNodeGetParams");
    SYM(memset_params, "cuGraphMemsetNodeGetParams");
    SYM(child_graph, "cuGraphChildGraphNodeGetGraph");
#undef SYM
    if (!g.get_nodes || !g.node_type || !g.memcpy_params || !g.memset_params || !g.child_graph || gc_copy_class_start() != 0) {
        gc_log("graphs traced node by node: the CUDA driver lacks the graph queries");
        return -1;
    }
    g.v = calloc(GV_SLOTS, sizeof(*g.v));
    g.x = calloc(GX_SLOTS, sizeof(*g.x));
    g.launch = calloc(GL_SLOTS, sizeof(*g.launch));
    if (!g.v || !g.x || !g.launch) {
        free(g.v), free(g.x), free((void *)g.launch);
        g.v = NULL, g.x = NULL, g.launch = NULL;
        gc_log("graphs traced node by node: no memory for the graph tables");
        return -1;
    }
    atomic_store(&g_on, 1);
    return 0;
}

/* Learning off (what tells us of graphs could not be had): the tables stay, a launch may be reading them. */
void gc_graphs_stop(void) { atomic_store(&g_on, 0); }
