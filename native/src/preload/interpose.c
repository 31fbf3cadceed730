/*
 * interpose.c - the driver's kernel launches, graph launches, copies and memsets seen without CUPTI, in a
 * process this library is LD_PRELOADed into (`run` preloads it; the default collector
 * then counts here, and CUPTI is never loaded).
 *
 * Why: CUPTI costs every launch whatever it is asked for: a subscriber's launch callbacks, its activity API
 * once set up even with every kind off, and graph replays a cost per node (docs/measurements.md); no CUPTI mode
 * came within 10 % of an untraced vLLM. What the census counts is
 * in the calls' own arguments, so we take the calls: since CUDA 11.3 the runtime takes every driver entry
 * point from cuGetProcAddress, which it finds with dlsym on libcuda, and triton and torch's NVRTC path
 * dlsym the launch calls by name. This library defines dlsym. A lookup whose answer is one of the driver
 * functions below (compared by address with what libcuda exports under that name, so the function's
 * signature is known, never guessed from a name) gets our wrapper instead, and so do cuGetProcAddress's
 * answers. A wrapper calls the driver's function and, while the census counts, notes what the call put on
 * the GPU; launches.c, calls.c and graphs.c fold it as they fold what CUPTI's callbacks report.
 *
 * A wrapped launch pays an indirect call, the current context (cuCtxGetCurrent: no CUPTI behind it) and
 * launches.c's two relaxed atomic adds; a copy what calls.c asks of the driver. Graph calls keep graphs.c's
 * tables: instantiations and updates walk the graph, destroys forget it, a launch notes its version.
 *
 * Not seen: a program that links libcuda and calls the driver's functions directly, without dlsym or
 * cuGetProcAddress (the CUDA runtime, torch, triton and llama.cpp do not), and the pre-13 batch copies
 * (cuMemcpyBatchAsync v1). The injector counts through CUPTI's callbacks instead when no driver function
 * was handed out through us by the time CUDA is initialised (gc_interpose_ready).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cuda.h>

#include "internal.h"

/* The legacy exports by their own names: cuda.h maps these names to their newer versions. */
#undef cuGraphInstantiate
#undef cuGraphExecUpdate
#undef cuStreamBeginCapture
#undef cuGetProcAddress
#undef cuCtxDestroy
#undef cuDevicePrimaryCtxRelease
#undef cuDevicePrimaryCtxReset
#undef cuMemcpyBatchAsync
#undef cuMemcpy3DBatchAsync
#undef cuMemAdvise
#undef cuMemPrefetchAsync
#undef cuMemPrefetchBatchAsync
#undef cuMemDiscardAndPrefetchBatchAsync
#undef cuMemAllocAsync
#undef cuMemAllocFromPoolAsync
#undef cuMemFreeAsync

typedef void *(*dlsym_fn)(void *, const char *);

/* A sanitizer (ASan, TSan) looks up its interceptors with dlsym while it sets up, before its shadow memory exists:
 * what runs then must not be instrumented. A no-op in the product's build. */
#if defined(__has_attribute) && __has_attribute(no_sanitize)
#define BEFORE_SANITIZERS __attribute__((no_sanitize("address", "thread")))
#else
#define BEFORE_SANITIZERS /* a compiler without the attribute (GCC < 8) */
#endif

/* glibc's dlsym, the next definition after ours (versions: glibc >= 2.34, then x86-64's and arm64's first). */
BEFORE_SANITIZERS static dlsym_fn real_dlsym(void)
{
    static _Atomic(dlsym_fn) f;
    dlsym_fn r = atomic_load_explicit(&f, memory_order_acquire);
    if (r) return r;
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    for (size_t i = 0; !r && i < sizeof(versions) / sizeof(versions[0]); i++)
        r = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    atomic_store_explicit(&f, r, memory_order_release);
    return r;
}

/* ---- what each wrapper reports ---- */

static atomic_int g_on;                   /* the injector counts through us (gc_interpose_start) */
static _Atomic uint32_t g_corr;           /* our correlation ids: a graph launch's contents, a call's step */
static _Atomic int g_handed;              /* driver functions handed out as wrappers */
static CUresult (*g_get_current)(CUcontext *);
static CUresult (*g_get_device)(CUdevice *);
static _Atomic uint32_t g_ctx_gen;        /* moves when a context may have gone: every cached device is asked again */
static __thread CUcontext t_ctx;
static __thread uint32_t t_gen;
static __thread int t_dev = -1;

/* The calling thread's device (-1: no context): the context's, asked again only when it changes or a
 * context went away (a new one may take its address on another device). */
static int cur_dev(void)
{
    CUcontext c = NULL;
    if (!g_get_current || g_get_current(&c) != CUDA_SUCCESS || !c) return -1;
    uint32_t gen = atomic_load_explicit(&g_ctx_gen, memory_order_acquire);
    if (c != t_ctx || t_dev < 0 || gen != t_gen) {
        CUdevice d = -1;
        t_dev = g_get_device && g_get_device(&d) == CUDA_SUCCESS && d >= 0 ? (int)d : -1;
        t_ctx = c;
        t_gen = gen;
    }
    return t_dev;
}

static uint32_t next_corr(void)
{
    uint32_t c = atomic_fetch_add_explicit(&g_corr, 1, memory_order_relaxed) + 1;
    return c ? c : atomic_fetch_add_explicit(&g_corr, 1, memory_order_relaxed) + 1;
}

static inline int counting(void) { return atomic_load_explicit(&g_on, memory_order_relaxed) && gc_launches_counting(); }

static void launched(CUstream s, int per_thread)
{
    if (!s && per_thread) s = CU_STREAM_PER_THREAD;
    if (gc_launches_capturing(s)) return;     /* recorded into a capture: its graph's launches count it */
    gc_launches_count(cur_dev());
}

/* ACTIVITY=events: a pair's slot when this launch is one of the sample (its first event recorded), else -1. The
 * stream as the driver reads it: NULL through a per-thread twin is the thread's own stream. */
static inline CUstream stream_as_called(CUstream s, int per_thread)
{
    return !s && per_thread ? CU_STREAM_PER_THREAD : s;
}

static int timed_before(int graph, CUstream s, int per_thread, const void *key)
{
    if (!gc_events_tick(graph ? key : NULL)) return -1;
    int dev = cur_dev();
    return gc_events_before(stream_as_called(s, per_thread), t_ctx, dev, (uintptr_t)key, graph);
}

static inline void timed_after(int ev, CUstream s, int per_thread, CUresult r, uint32_t corr)
{
    if (ev >= 0) gc_events_after(ev, stream_as_called(s, per_thread), r == CUDA_SUCCESS, corr, t_dev);
}

/* A copy or memset call (calls.c's table) that succeeded; `p` its arguments laid out as CUPTI's params. */
static void called(int calls_index, int per_thread, const void *p)
{
    uint32_t corr = next_corr();
    gc_steps_note(corr);
    gc_calls_note(calls_index, per_thread, p, cur_dev(), corr);
}

/* A managed-memory call that succeeded (managed.c): allocations and frees whenever the census is on, so that it
 * knows what is live also across a pause; advice and prefetches while it counts. */
static void managed(int call, const void *p)
{
    if (call == GC_M_FREE) gc_managed_free(((const CUdeviceptr *)p)[0]);
    else if (call == GC_M_ALLOC || call == GC_M_POOL_ALLOC || counting()) gc_managed_call(call, p, cur_dev());
}

/* ---- the wrapped functions ----
 *
 * Each entry: a driver function by its exported name, and its per-thread-stream twin (_ptsz or _ptds,
 * whichever libcuda exports); a wrapper for each. X(name, kind, arity, types...) lists them. */
enum kind { K_COPY, K_LAUNCH, K_LAUNCH_EX, K_GRAPH_LAUNCH, K_INSTANTIATE, K_UPDATE, K_DESTROY, K_CHANGE, K_BEGIN,
            K_END, K_GPA, K_CTX_GONE, K_INIT, K_MANAGED };

#define ENTRIES(X)                                                                                           \
    X(cuMemcpy, K_COPY, 3, CUdeviceptr, CUdeviceptr, size_t)                                                 \
    X(cuMemcpyAsync, K_COPY, 4, CUdeviceptr, CUdeviceptr, size_t, CUstream)                                  \
    X(cuMemcpyHtoD_v2, K_COPY, 3, CUdeviceptr, const void *, size_t)                                         \
    X(cuMemcpyHtoDAsync_v2, K_COPY, 4, CUdeviceptr, const void *, size_t, CUstream)                          \
    X(cuMemcpyDtoH_v2, K_COPY, 3, void *, CUdeviceptr, size_t)                                               \
    X(cuMemcpyDtoHAsync_v2, K_COPY, 4, void *, CUdeviceptr, size_t, CUstream)                                \
    X(cuMemcpyDtoD_v2, K_COPY, 3, CUdeviceptr, CUdeviceptr, size_t)                                          \
    X(cuMemcpyDtoDAsync_v2, K_COPY, 4, CUdeviceptr, CUdeviceptr, size_t, CUstream)                           \
    X(cuMemcpyDtoA_v2, K_COPY, 4, CUarray, size_t, CUdeviceptr, size_t)                                      \
    X(cuMemcpyAtoD_v2, K_COPY, 4, CUdeviceptr, CUarray, size_t, size_t)                                      \
    X(cuMemcpyHtoA_v2, K_COPY, 4, CUarray, size_t, const void *, size_t)                                     \
    X(cuMemcpyHtoAAsync_v2, K_COPY, 5, CUarray, size_t, const void *, size_t, CUstream)                      \
    X(cuMemcpyAtoH_v2, K_COPY, 4, void *, CUarray, size_t, size_t)                                           \
    X(cuMemcpyAtoHAsync_v2, K_COPY, 5, void *, CUarray, size_t, size_t, CUstream)                            \
    X(cuMemcpyAtoA_v2, K_COPY, 5, CUarray, size_t, CUarray, size_t, size_t)                                  \
    X(cuMemcpyPeer, K_COPY, 5, CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t)                       \
    X(cuMemcpyPeerAsync, K_COPY, 6, CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream)        \
    X(cuMemcpy2D_v2, K_COPY, 1, const CUDA_MEMCPY2D *)                                                       \
    X(cuMemcpy2DUnaligned_v2, K_COPY, 1, const CUDA_MEMCPY2D *)                                              \
    X(cuMemcpy2DAsync_v2, K_COPY, 2, const CUDA_MEMCPY2D *, CUstream)                                        \
    X(cuMemcpy3D_v2, K_COPY, 1, const CUDA_MEMCPY3D *)                                                       \
    X(cuMemcpy3DAsync_v2, K_COPY, 2, const CUDA_MEMCPY3D *, CUstream)                                        \
    X(cuMemcpy3DPeer, K_COPY, 1, const CUDA_MEMCPY3D_PEER *)                                                 \
    X(cuMemcpy3DPeerAsync, K_COPY, 2, const CUDA_MEMCPY3D_PEER *, CUstream)                                  \
    X(cuMemsetD8_v2, K_COPY, 3, CUdeviceptr, unsigned char, size_t)                                          \
    X(cuMemsetD16_v2, K_COPY, 3, CUdeviceptr, unsigned short, size_t)                                        \
    X(cuMemsetD32_v2, K_COPY, 3, CUdeviceptr, unsigned int, size_t)                                          \
    X(cuMemsetD8Async, K_COPY, 4, CUdeviceptr, unsigned char, size_t, CUstream)                              \
    X(cuMemsetD16Async, K_COPY, 4, CUdeviceptr, unsigned short, size_t, CUstream)                            \
    X(cuMemsetD32Async, K_COPY, 4, CUdeviceptr, unsigned int, size_t, CUstream)                              \
    X(cuMemsetD2D8_v2, K_COPY, 5, CUdeviceptr, size_t, unsigned char, size_t, size_t)                        \
    X(cuMemsetD2D16_v2, K_COPY, 5, CUdeviceptr, size_t, unsigned short, size_t, size_t)                      \
    X(cuMemsetD2D32_v2, K_COPY, 5, CUdeviceptr, size_t, unsigned int, size_t, size_t)                        \
    X(cuMemsetD2D8Async, K_COPY, 6, CUdeviceptr, size_t, unsigned char, size_t, size_t, CUstream)            \
    X(cuMemsetD2D16Async, K_COPY, 6, CUdeviceptr, size_t, unsigned short, size_t, size_t, CUstream)          \
    X(cuMemsetD2D32Async, K_COPY, 6, CUdeviceptr, size_t, unsigned int, size_t, size_t, CUstream)            \
    X(cuMemcpyBatchAsync, K_COPY, 9, CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *,   \
      size_t *, size_t, size_t *, CUstream)                                                                  \
    X(cuMemcpy3DBatchAsync, K_COPY, 5, size_t, CUDA_MEMCPY3D_BATCH_OP *, size_t *, unsigned long long, CUstream) \
    X(cuMemcpyBatchAsync_v2, K_COPY, 8, CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, \
      size_t *, size_t, CUstream)                                                                            \
    X(cuMemcpy3DBatchAsync_v2, K_COPY, 4, size_t, CUDA_MEMCPY3D_BATCH_OP *, unsigned long long, CUstream)    \
    X(cuMemcpyWithAttributesAsync, K_COPY, 5, CUdeviceptr, CUdeviceptr, size_t, CUmemcpyAttributes *, CUstream) \
    X(cuMemcpy3DWithAttributesAsync, K_COPY, 3, CUDA_MEMCPY3D_BATCH_OP *, unsigned long long, CUstream)      \
    X(cuGraphLaunch, K_GRAPH_LAUNCH, 2, CUgraphExec, CUstream)                                               \
    X(cuLaunchKernel, K_LAUNCH, 11, CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,      \
      unsigned int, unsigned int, unsigned int, CUstream, void **, void **)                                  \
    X(cuLaunchCooperativeKernel, K_LAUNCH, 10, CUfunction, unsigned int, unsigned int, unsigned int,         \
      unsigned int, unsigned int, unsigned int, unsigned int, CUstream, void **)                             \
    X(cuLaunchKernelEx, K_LAUNCH_EX, 4, const CUlaunchConfig *, CUfunction, void **, void **)                \
    X(cuGraphInstantiateWithFlags, K_INSTANTIATE, 3, CUgraphExec *, CUgraph, unsigned long long)             \
    X(cuGraphInstantiateWithParams, K_INSTANTIATE, 3, CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *) \
    X(cuGraphInstantiate, K_INSTANTIATE, 5, CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t)           \
    X(cuGraphInstantiate_v2, K_INSTANTIATE, 5, CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t)        \
    X(cuGraphExecUpdate_v2, K_UPDATE, 3, CUgraphExec, CUgraph, CUgraphExecUpdateResultInfo *)                \
    X(cuGraphExecUpdate, K_UPDATE, 4, CUgraphExec, CUgraph, CUgraphNode *, CUgraphExecUpdateResult *)        \
    X(cuGraphExecDestroy, K_DESTROY, 1, CUgraphExec)                                                         \
    X(cuGraphExecMemcpyNodeSetParams, K_CHANGE, 4, CUgraphExec, CUgraphNode, const CUDA_MEMCPY3D *, CUcontext) \
    X(cuGraphExecMemsetNodeSetParams, K_CHANGE, 4, CUgraphExec, CUgraphNode, const CUDA_MEMSET_NODE_PARAMS *, \
      CUcontext)                                                                                             \
    X(cuGraphExecNodeSetParams, K_CHANGE, 3, CUgraphExec, CUgraphNode, CUgraphNodeParams *)                  \
    X(cuGraphExecChildGraphNodeSetParams, K_CHANGE, 3, CUgraphExec, CUgraphNode, CUgraph)                    \
    X(cuGraphNodeSetEnabled, K_CHANGE, 3, CUgraphExec, CUgraphNode, unsigned int)                            \
    X(cuStreamBeginCapture, K_BEGIN, 1, CUstream)                                                            \
    X(cuStreamBeginCapture_v2, K_BEGIN, 2, CUstream, CUstreamCaptureMode)                                    \
    X(cuStreamBeginCaptureToGraph, K_BEGIN, 6, CUstream, CUgraph, const CUgraphNode *, const CUgraphEdgeData *, \
      size_t, CUstreamCaptureMode)                                                                           \
    X(cuStreamBeginCaptureToCig, K_BEGIN, 2, CUstream, CUstreamCigCaptureParams *)                           \
    X(cuStreamBeginRecaptureToGraph, K_BEGIN, 5, CUstream, CUstreamCaptureMode, CUgraph,                     \
      CUgraphRecaptureCallback, void *)                                                                      \
    X(cuStreamEndCapture, K_END, 2, CUstream, CUgraph *)                                                     \
    X(cuStreamEndCaptureToCig, K_END, 1, CUstream)                                                           \
    X(cuCtxDestroy_v2, K_CTX_GONE, 1, CUcontext)                                                             \
    X(cuDevicePrimaryCtxRelease_v2, K_CTX_GONE, 1, CUdevice)                                                 \
    X(cuDevicePrimaryCtxReset_v2, K_CTX_GONE, 1, CUdevice)                                                   \
    X(cuInit, K_INIT, 1, unsigned int)                                                                       \
    X(cuMemAllocManaged, K_MANAGED, 3, CUdeviceptr *, size_t, unsigned int)                                  \
    X(cuMemAllocAsync, K_MANAGED, 3, CUdeviceptr *, size_t, CUstream)                                        \
    X(cuMemAllocFromPoolAsync, K_MANAGED, 4, CUdeviceptr *, size_t, CUmemoryPool, CUstream)                  \
    X(cuMemFree_v2, K_MANAGED, 1, CUdeviceptr)                                                               \
    X(cuMemFreeAsync, K_MANAGED, 2, CUdeviceptr, CUstream)                                                   \
    X(cuMemAdvise, K_MANAGED, 4, CUdeviceptr, size_t, CUmem_advise, CUdevice)                                \
    X(cuMemAdvise_v2, K_MANAGED, 4, CUdeviceptr, size_t, CUmem_advise, CUmemLocation)                        \
    X(cuMemPrefetchAsync, K_MANAGED, 4, CUdeviceptr, size_t, CUdevice, CUstream)                             \
    X(cuMemPrefetchAsync_v2, K_MANAGED, 5, CUdeviceptr, size_t, CUmemLocation, unsigned int, CUstream)       \
    X(cuMemPrefetchBatchAsync, K_MANAGED, 8, CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *,     \
      size_t, unsigned long long, CUstream)                                                                  \
    X(cuMemDiscardAndPrefetchBatchAsync, K_MANAGED, 8, CUdeviceptr *, size_t *, size_t, CUmemLocation *,     \
      size_t *, size_t, unsigned long long, CUstream)                                                        \
    X(cuGetProcAddress_v2, K_GPA, 5, const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) \
    X(cuGetProcAddress, K_GPA, 4, const char *, void **, int, cuuint64_t)

#define ID(name) E_##name
#define ENUM(name, kind, n, ...) ID(name),
enum { ENTRIES(ENUM) NENTRIES };

static struct entry {
    const char *name;
    uint8_t kind;
    _Atomic int calls;         /* K_COPY, K_GRAPH_LAUNCH: calls.c's index; K_MANAGED: managed.c's GC_M_* */
    void *wrap[2];             /* [per-thread twin?] */
    void *_Atomic real[2];     /* libcuda's, resolved once libcuda is loaded; NULL: not exported */
} g_e[NENTRIES];

/* The arguments as a parameter list, a call's argument list and an initializer, by arity. */
#define P1(T0) T0 a0
#define P2(T0, T1) P1(T0), T1 a1
#define P3(T0, T1, T2) P2(T0, T1), T2 a2
#define P4(T0, T1, T2, T3) P3(T0, T1, T2), T3 a3
#define P5(T0, T1, T2, T3, T4) P4(T0, T1, T2, T3), T4 a4
#define P6(T0, T1, T2, T3, T4, T5) P5(T0, T1, T2, T3, T4), T5 a5
#define P7(T0, T1, T2, T3, T4, T5, T6) P6(T0, T1, T2, T3, T4, T5), T6 a6
#define P8(T0, T1, T2, T3, T4, T5, T6, T7) P7(T0, T1, T2, T3, T4, T5, T6), T7 a7
#define P9(T0, T1, T2, T3, T4, T5, T6, T7, T8) P8(T0, T1, T2, T3, T4, T5, T6, T7), T8 a8
#define P10(T0, T1, T2, T3, T4, T5, T6, T7, T8, T9) P8(T0, T1, T2, T3, T4, T5, T6, T7), T8 a8, T9 a9
#define P11(T0, T1, T2, T3, T4, T5, T6, T7, T8, T9, T10) P10(T0, T1, T2, T3, T4, T5, T6, T7, T8, T9), T10 a10
#define A1 a0
#define A2 A1, a1
#define A3 A2, a2
#define A4 A3, a3
#define A5 A4, a4
#define A6 A5, a5
#define A7 A6, a6
#define A8 A7, a7
#define A9 A8, a8
#define A10 A8, a8, a9
#define A11 A10, a10
#define PARAMS(n, ...) P##n(__VA_ARGS__)
#define ARGS(n) A##n
/* the params struct: CUPTI's layout for the call (each argument a member, in order) */
#define M1(T0) T0 a0;
#define M2(T0, T1) M1(T0) T1 a1;
#define M3(T0, T1, T2) M2(T0, T1) T2 a2;
#define M4(T0, T1, T2, T3) M3(T0, T1, T2) T3 a3;
#define M5(T0, T1, T2, T3, T4) M4(T0, T1, T2, T3) T4 a4;
#define M6(T0, T1, T2, T3, T4, T5) M5(T0, T1, T2, T3, T4) T5 a5;
#define M7(T0, T1, T2, T3, T4, T5, T6) M6(T0, T1, T2, T3, T4, T5) T6 a6;
#define M8(T0, T1, T2, T3, T4, T5, T6, T7) M7(T0, T1, T2, T3, T4, T5, T6) T7 a7;
#define M9(T0, T1, T2, T3, T4, T5, T6, T7, T8) M8(T0, T1, T2, T3, T4, T5, T6, T7) T8 a8;
#define M10(T0, T1, T2, T3, T4, T5, T6, T7, T8, T9) M8(T0, T1, T2, T3, T4, T5, T6, T7) T8 a8; T9 a9;
#define M11(T0, T1, T2, T3, T4, T5, T6, T7, T8, T9, T10) M10(T0, T1, T2, T3, T4, T5, T6, T7, T8, T9) T10 a10;
#define MEMBERS(n, ...) M##n(__VA_ARGS__)

static CUresult gpa_answer(CUresult r, const char *name, void **pfn);

/* What a wrapper does before and after the driver's call; `pt`: the per-thread twin, a0..: the arguments.
 * Nothing until the injector counts through us (a census through CUPTI follows the same calls itself). */
#define BEFORE_K_COPY(name, pt)
/* ACTIVITY=events: a sampled launch gets an event pair around it on its stream (events.c) */
#define BEFORE_K_LAUNCH(name, pt) int ev = counting() ? timed_before(0, a8, pt, a0) : -1;
#define BEFORE_K_LAUNCH_EX(name, pt) int ev = counting() ? timed_before(0, a0 ? a0->hStream : NULL, pt, a1) : -1;
#define BEFORE_K_GRAPH_LAUNCH(name, pt)                                                                      \
    uint32_t corr = 0;                                                                                       \
    int ev = -1;                                                                                             \
    if (counting()) { /* the exec's contents as of the launch, as graphs.c notes them at CUPTI's enter */   \
        corr = next_corr();                                                                                  \
        gc_graphs_launch(a0, corr);                                                                          \
        gc_steps_note(corr);                                                                                 \
        ev = timed_before(1, a1, pt, a0);                                                                      \
        if (ev >= 0) gc_graphs_timed_launch(a0, corr);                                                       \
    }
#define BEFORE_K_INSTANTIATE(name, pt)
#define BEFORE_K_UPDATE(name, pt)
#define BEFORE_K_DESTROY(name, pt) if (gc_interpose_on()) gc_graphs_forget(a0);
#define BEFORE_K_CHANGE(name, pt)
#define BEFORE_K_BEGIN(name, pt)
#define BEFORE_K_END(name, pt)
#define BEFORE_K_GPA(name, pt)
#define BEFORE_K_CTX_GONE(name, pt) gc_events_context_going(ID(name) == ID(cuCtxDestroy_v2), (uintptr_t)a0);
#define BEFORE_K_INIT(name, pt)
#define BEFORE_K_MANAGED(name, pt)

#define AFTER_K_COPY(name, n, pt, ...)                                                                       \
    if (r == CUDA_SUCCESS && counting()) {                                                                   \
        struct { MEMBERS(n, __VA_ARGS__) } p = {ARGS(n)};                                                    \
        called(g_e[ID(name)].calls, pt, &p);                                                                 \
    }
#define AFTER_K_LAUNCH(name, n, pt, ...)                                                                     \
    timed_after(ev, a8, pt, r, 0);                                                                           \
    if (r == CUDA_SUCCESS && counting()) launched(a8, pt);
#define AFTER_K_LAUNCH_EX(name, n, pt, ...)                                                                  \
    timed_after(ev, a0 ? a0->hStream : NULL, pt, r, 0);                                                      \
    if (r == CUDA_SUCCESS && counting()) launched(a0 ? a0->hStream : NULL, pt);
#define AFTER_K_GRAPH_LAUNCH(name, n, pt, ...)                                                               \
    timed_after(ev, a1, pt, r, corr);                                                                        \
    if (r == CUDA_SUCCESS && corr) {                                                                         \
        struct { MEMBERS(n, __VA_ARGS__) } p = {ARGS(n)};                                                    \
        gc_calls_note(g_e[ID(name)].calls, pt, &p, cur_dev(), corr);                                        \
    }
#define AFTER_K_INSTANTIATE(name, n, pt, ...) if (r == CUDA_SUCCESS && a0 && gc_interpose_on()) gc_graphs_learn(*a0, a1);
#define AFTER_K_UPDATE(name, n, pt, ...) if (r == CUDA_SUCCESS && gc_interpose_on()) gc_graphs_learn(a0, a1);
#define AFTER_K_DESTROY(name, n, pt, ...)
#define AFTER_K_CHANGE(name, n, pt, ...) if (r == CUDA_SUCCESS && gc_interpose_on()) gc_graphs_changed(a0);
#define AFTER_K_BEGIN(name, n, pt, ...) if (gc_interpose_on()) gc_launches_capture(1, r == CUDA_SUCCESS);
#define AFTER_K_END(name, n, pt, ...) if (gc_interpose_on()) gc_launches_capture(0, r == CUDA_SUCCESS);
#define AFTER_K_GPA(name, n, pt, ...) r = gpa_answer(r, a0, a1);
#define AFTER_K_CTX_GONE(name, n, pt, ...) atomic_fetch_add_explicit(&g_ctx_gen, 1, memory_order_release);
#define AFTER_K_INIT(name, n, pt, ...)
#define AFTER_K_MANAGED(name, n, pt, ...)                                                                    \
    if (r == CUDA_SUCCESS && gc_interpose_on()) {                                                            \
        struct { MEMBERS(n, __VA_ARGS__) } p = {ARGS(n)};                                                    \
        managed(g_e[ID(name)].calls, &p);                                                                    \
    }

/* A driver function that calls another through its exports (a library linked with -lcuda, or a driver whose own
 * calls go through its PLT) would reach a second wrapper: only the outermost one counts. */
static __thread int t_inside;

#define WRAPPER(name, kind, n, pt, ...)                                                                      \
    static CUresult w_##name##_##pt(PARAMS(n, __VA_ARGS__))                                                  \
    {                                                                                                        \
        CUresult (*f)(__VA_ARGS__) =                                                                         \
            (CUresult (*)(__VA_ARGS__))atomic_load_explicit(&g_e[ID(name)].real[pt], memory_order_relaxed);  \
        if (t_inside) return f(ARGS(n));                                                                     \
        t_inside = 1;                                                                                        \
        BEFORE_##kind(name, pt)                                                                              \
        CUresult r = f(ARGS(n));                                                                             \
        AFTER_##kind(name, n, pt, __VA_ARGS__)                                                               \
        t_inside = 0;                                                                                        \
        return r;                                                                                            \
    }
#define WRAPPERS(name, kind, n, ...) WRAPPER(name, kind, n, 0, __VA_ARGS__) WRAPPER(name, kind, n, 1, __VA_ARGS__)
ENTRIES(WRAPPERS)

/* The same functions exported under the driver's own names (and its per-thread twins'), so that a library linked
 * against libcuda, whose calls the dynamic linker binds to the first definition in the process, calls our
 * wrappers: this library is preloaded, so it comes first. exports.map exports every cu* symbol. */
static int linked(int i, int pt, const char *sym);
#define EXPORT(name, pt, sym, n, ...)                                                                        \
    __attribute__((visibility("default"))) CUresult sym(PARAMS(n, __VA_ARGS__))                              \
    {                                                                                                        \
        if (!linked(ID(name), pt, #sym)) return CUDA_ERROR_NOT_FOUND;                                        \
        return w_##name##_##pt(ARGS(n));                                                                     \
    }
#define EXPORTS(name, kind, n, ...)                                                                          \
    EXPORT(name, 0, name, n, __VA_ARGS__) EXPORT(name, 1, name##_ptsz, n, __VA_ARGS__)                       \
    EXPORT(name, 1, name##_ptds, n, __VA_ARGS__)
ENTRIES(EXPORTS)

/* Our exports by address: a driver that takes its own functions' addresses through its GOT hands these out (the
 * dynamic linker bound them to us), and they are wrappers already. */
#define EXPORTED(name, kind, n, ...) (void *)name, (void *)name##_ptsz, (void *)name##_ptds,
static void *const g_exported[] = {ENTRIES(EXPORTED)};
#define NEXPORTED (sizeof(g_exported) / sizeof(g_exported[0]))

#define INIT(name, kind, n, ...) [ID(name)] = {#name, kind, -1, {(void *)w_##name##_0, (void *)w_##name##_1}, {NULL, NULL}},
static struct entry g_e[NENTRIES] = {ENTRIES(INIT)};

/* ---- the table: libcuda's functions by address ---- */

static atomic_int g_resolved;              /* libcuda was loaded and the table filled */

/* Fill the table from the libcuda in the process (none loaded yet: tried again at the next lookup). No lock:
 * two threads filling it at once store the same values (a lock held across dlopen could deadlock against a
 * library constructor that looks a driver function up under the loader's lock). */
static int managed_call(const char *name)
{
    static const struct { const char *name; int call; } t[] = {
        {"cuMemAllocManaged", GC_M_ALLOC}, {"cuMemAllocAsync", GC_M_POOL_ALLOC}, {"cuMemAllocFromPoolAsync", GC_M_POOL_ALLOC},
        {"cuMemFree_v2", GC_M_FREE}, {"cuMemFreeAsync", GC_M_FREE}, {"cuMemAdvise", GC_M_ADVISE}, {"cuMemAdvise_v2", GC_M_ADVISE2},
        {"cuMemPrefetchAsync", GC_M_PREFETCH}, {"cuMemPrefetchAsync_v2", GC_M_PREFETCH2},
        {"cuMemPrefetchBatchAsync", GC_M_PREFETCH_BATCH}, {"cuMemDiscardAndPrefetchBatchAsync", GC_M_PREFETCH_BATCH},
    };
    for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
        if (strcmp(name, t[i].name) == 0) return t[i].call;
    return GC_M_NONE;
}

static int resolve(void)
{
    if (atomic_load_explicit(&g_resolved, memory_order_acquire)) return 1;
    dlsym_fn sym = real_dlsym();
    void *cuda = sym ? dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD) : NULL;
    if (!cuda) return 0;
    for (int i = 0; i < NENTRIES; i++) {
        struct entry *e = &g_e[i];
        static const char *const suffix[] = {"_ptsz", "_ptds"};
        char twin[96];
        void *t = NULL;
        atomic_store(&e->real[0], sym(cuda, e->name));
        for (int k = 0; k < 2 && !t; k++)
            if ((size_t)snprintf(twin, sizeof(twin), "%s%s", e->name, suffix[k]) < sizeof(twin)) t = sym(cuda, twin);
        atomic_store(&e->real[1], t);
        if (e->kind == K_COPY || e->kind == K_GRAPH_LAUNCH) atomic_store(&e->calls, gc_calls_index(e->name));
        if (e->kind == K_MANAGED) atomic_store(&e->calls, managed_call(e->name));
    }
    CUresult (*cur)(CUcontext *) = (CUresult (*)(CUcontext *))sym(cuda, "cuCtxGetCurrent");
    CUresult (*dev)(CUdevice *) = (CUresult (*)(CUdevice *))sym(cuda, "cuCtxGetDevice");
    if (!cur || !dev) return 0;   /* not a driver we can follow: nothing is wrapped */
    g_get_current = cur;
    g_get_device = dev;
    atomic_store_explicit(&g_resolved, 1, memory_order_release);
    return 1;
}

static _Atomic int g_linked;   /* a call reached one of our exports: a library linked against libcuda calls us */

/* The driver's function behind export `sym` (entry i, twin pt), for a caller that never asked dlsym. */
static int linked(int i, int pt, const char *sym)
{
    if (!atomic_load_explicit(&g_linked, memory_order_relaxed)) atomic_store(&g_linked, 1);
    if (atomic_load_explicit(&g_e[i].real[pt], memory_order_acquire)) return 1;
    (void)resolve();
    if (atomic_load_explicit(&g_e[i].real[pt], memory_order_acquire)) return 1;
    /* no libcuda we can follow: the next definition in the process, called as it is */
    dlsym_fn sym_fn = real_dlsym();
    void *f = sym_fn ? sym_fn(RTLD_NEXT, sym) : NULL;
    if (f) atomic_store_explicit(&g_e[i].real[pt], f, memory_order_release);
    return f != NULL;
}

/* ---- driver functions that put work on the GPU and that we have no wrapper for ----
 * A newer driver's copy or launch function (or an old version of one, asked for by an old CUDA version) would move
 * bytes or run kernels the census cannot size. Such a function is handed out as a trampoline that counts its calls
 * and jumps to it, touching neither argument registers nor the stack, so any signature passes through unchanged:
 * the census then says how many calls it could not size (never a silent gap). Fetched but never called costs
 * nothing and says nothing. No trampolines on other CPUs, or once all are taken: the function is counted as
 * unwrapped, and the census says its calls were not even counted. */
#define TRAMPOLINES 64
__attribute__((used)) static void *volatile g_tramp_real[TRAMPOLINES];
__attribute__((used)) static uint64_t g_tramp_calls[TRAMPOLINES];
static char g_tramp_name[TRAMPOLINES][48];
static _Atomic int g_tramps;
static uint8_t g_tramp_said[TRAMPOLINES];   /* the flusher's: its line was written */
static _Atomic uint64_t g_unwrapped;
static char g_unwrapped_name[48];
static _Atomic int g_unwrapped_named;

#if defined(__x86_64__)
/* slot i at gc_tramp_base + 32 * i: endbr64 (indirect-branch tracking), one locked add, an indirect jump */
__asm__(".pushsection .text\n"
        ".p2align 5\n"
        "gc_tramp_base:\n"
        ".set gc_tramp_i, 0\n"
        ".rept 64\n"
        ".p2align 5\n"
        "endbr64\n"
        "lock addq $1, g_tramp_calls+8*gc_tramp_i(%rip)\n"
        "jmp *g_tramp_real+8*gc_tramp_i(%rip)\n"
        ".set gc_tramp_i, gc_tramp_i+1\n"
        ".endr\n"
        ".popsection\n");
extern char gc_tramp_base[];
_Static_assert(TRAMPOLINES == 64, "the .rept count above");
#define HAVE_TRAMPOLINES 1
#else
#define HAVE_TRAMPOLINES 0
#endif

/* A name of a driver function that puts work on the GPU: copies, memsets, prefetches, kernel and graph launches (not a
 * host function queued on a stream). */
BEFORE_SANITIZERS static int work_name(const char *name)
{
    if (!name || name[0] != 'c' || name[1] != 'u') return 0;
    if (strncmp(name, "cuLaunchHostFunc", 16) == 0) return 0;
    return strncmp(name, "cuMemcpy", 8) == 0 || strncmp(name, "cuMemset", 8) == 0 || strncmp(name, "cuLaunch", 8) == 0 ||
           strncmp(name, "cuGraphLaunch", 13) == 0 || strncmp(name, "cuMemPrefetch", 13) == 0 ||
           strncmp(name, "cuMemDiscardAndPrefetch", 23) == 0;
}

static void *unknown_work(void *p, const char *name)
{
#if HAVE_TRAMPOLINES
    int n = atomic_load(&g_tramps);
    for (int i = 0; i < n && i < TRAMPOLINES; i++)
        if (g_tramp_real[i] == p) return gc_tramp_base + 32 * i;
    int i = atomic_fetch_add(&g_tramps, 1);
    if (i < TRAMPOLINES) {
        snprintf(g_tramp_name[i], sizeof(g_tramp_name[i]), "%s", name);
        g_tramp_real[i] = p;
        __atomic_thread_fence(__ATOMIC_RELEASE);
        return gc_tramp_base + 32 * i;
    }
#endif
    atomic_fetch_add(&g_unwrapped, 1);
    int no = 0;
    if (atomic_compare_exchange_strong(&g_unwrapped_named, &no, 1)) {
        snprintf(g_unwrapped_name, sizeof(g_unwrapped_name), "%s", name);
        gc_log("%s puts work on the GPU and the census has no wrapper for it: its calls are not counted", name);
    }
    return p;
}

/* Our wrapper for libcuda's function at `p` (asked for by `name`, NULL: not known), or `p` itself. */
static void *answer(void *p, const char *name)
{
    if (!p || !atomic_load_explicit(&g_resolved, memory_order_acquire)) return p;
    for (size_t i = 0; i < NEXPORTED; i++) {
        if (g_exported[i] != p) continue;
        atomic_fetch_add_explicit(&g_handed, 1, memory_order_relaxed);
        return p;
    }
    for (int i = 0; i < NENTRIES; i++) {
        for (int t = 0; t < 2; t++) {
            if (atomic_load_explicit(&g_e[i].real[t], memory_order_relaxed) != p) continue;
            /* a copy calls.c does not know (never, by the table) is counted, not sized */
            if ((g_e[i].kind == K_COPY || g_e[i].kind == K_GRAPH_LAUNCH) && atomic_load(&g_e[i].calls) < 0)
                return unknown_work(p, g_e[i].name);
            atomic_fetch_add_explicit(&g_handed, 1, memory_order_relaxed);
            return g_e[i].wrap[t];
        }
    }
    return work_name(name) ? unknown_work(p, name) : p;
}

static CUresult gpa_answer(CUresult r, const char *name, void **pfn)
{
    if (r == CUDA_SUCCESS && pfn && *pfn) *pfn = answer(*pfn, name);
    return r;
}

BEFORE_SANITIZERS static int named(const char *name)
{
    if (name[0] != 'c' || name[1] != 'u') return 0;
    for (int i = 0; i < NENTRIES; i++) {
        size_t n = strlen(g_e[i].name);
        if (strncmp(name, g_e[i].name, n) == 0 &&
            (name[n] == 0 || strcmp(name + n, "_ptsz") == 0 || strcmp(name + n, "_ptds") == 0))
            return 1;
    }
    return 0;
}

/* The process's dlsym (this library is preloaded). RTLD_NEXT is relative to its caller, so that lookup is
 * passed on as a tail call: glibc then sees the caller's return address, not ours (a test holds this). */
#if defined(__clang__)                 /* clang makes sibling calls at -O1 and up, and knows no optimize() */
#define SIBLING_CALLS
#else
#define SIBLING_CALLS __attribute__((optimize("optimize-sibling-calls")))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnonnull-compare"   /* glibc declares name nonnull; a caller may still pass NULL */
#endif
__attribute__((visibility("default"))) SIBLING_CALLS BEFORE_SANITIZERS
void *dlsym(void *handle, const char *name)
{
    dlsym_fn real = real_dlsym();
    if (!real) return NULL;
    if (handle == RTLD_NEXT || !name || !(named(name) || work_name(name))) return real(handle, name);
    (void)resolve();   /* first: the caller's lookup below is the last one, and dlerror() says how it went */
    return answer(real(handle, name), name);
}
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/* ---- the injector's ---- */

int gc_interpose_ready(void)
{
    if (!atomic_load(&g_resolved) && atomic_load(&g_linked)) (void)resolve();   /* cuInit came through our export */
    return atomic_load(&g_resolved) && (atomic_load(&g_handed) > 0 || atomic_load(&g_linked)) && g_get_current &&
           g_get_device;
}

void gc_interpose_unseen(gc_segment *seg)
{
    uint64_t calls = 0;
    const char *first = NULL;
#if HAVE_TRAMPOLINES
    int n = atomic_load(&g_tramps);
    for (int i = 0; i < n && i < TRAMPOLINES; i++) {
        uint64_t c = __atomic_load_n(&g_tramp_calls[i], __ATOMIC_RELAXED);
        if (!c) continue;
        calls += c;
        if (!first) first = g_tramp_name[i];
        if (!g_tramp_said[i]) {   /* one line a function, the first time it is seen called */
            g_tramp_said[i] = 1;
            gc_log("%s was called %llu times: it puts work on the GPU and the census has no wrapper for it (counted "
                   "as unsized, in no total)", g_tramp_name[i], (unsigned long long)c);
        }
    }
#endif
    seg->unsized_calls = calls;
    seg->unwrapped = atomic_load(&g_unwrapped);
    if (!first && seg->unwrapped) first = g_unwrapped_name;
    if (first) {   /* both names hold 48 bytes, NUL-terminated */
        memcpy(seg->unsized_name, first, sizeof(seg->unsized_name));
        seg->unsized_name[sizeof(seg->unsized_name) - 1] = 0;
    }
}

void gc_interpose_start(void) { atomic_store(&g_on, 1); }
/* A forked child: its wrappers only pass calls through (the parent's locks may be held in its copy). */
void gc_interpose_stop(void) { atomic_store(&g_on, 0); }
int gc_interpose_on(void) { return atomic_load_explicit(&g_on, memory_order_relaxed); }
