/* internal.h - what the injector's units share; not part of the reader contract. */
#ifndef GC_INTERNAL_H
#define GC_INTERNAL_H

#include <stdint.h>
#include <cupti.h>

#include "gpu_census.h"

/* The newest record structs of the CUPTI headers we build with. tally.c reads only fields
 * whose offsets every 13.x version shares, and asserts that. */
#if CUPTI_API_VERSION >= 130500
#define GC_KERNEL_T CUpti_ActivityKernel13
#define GC_MEMCPY_T CUpti_ActivityMemcpy7
#define GC_MEMSET_T CUpti_ActivityMemset5
#else
/* Records of CUPTI 13.0-13.4 have the same offsets for what we read (asserted in tally.c),
 * but the multi-subscriber API we use where it exists first appears in these headers. */
#error "otel-gpu-census builds against CUPTI >= 13.5 headers (pip wheel nvidia-cuda-cupti)"
#endif

/* The external-correlation kind the tally accepts as steps (records a CUPTI may emit, and tests);
 * torch/kineto use CUSTOM0 and CUSTOM1. The injector itself tags steps through steps.c. */
#define GC_EXTERNAL_KIND CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM2

/* config.c: the injector's settings, read and checked once at start. */
struct gc_config {
    const char *cupti_path;     /* OTEL_GPU_CENSUS_CUPTI */
    size_t buffer_size;         /* OTEL_GPU_CENSUS_BUFFER_KB */
    int max_buffers;            /* OTEL_GPU_CENSUS_MAX_BUFFERS */
    uint32_t flush_ms;          /* OTEL_GPU_CENSUS_FLUSH_MS */
    uint32_t graph_mode;        /* OTEL_GPU_CENSUS_GRAPHS: enum gc_graphs (launch unless node) */
    int graph_named;            /* OTEL_GPU_CENSUS_GRAPHS was set: say so when it cannot be had */
    int api_v1;                 /* OTEL_GPU_CENSUS_CUPTI_API=v1 */
    int api_named;              /* OTEL_GPU_CENSUS_CUPTI_API set (v1 or v2): no automatic choice */
    int calls;                  /* the default collector: everything counted at its call by the library
                                 * preloaded (interpose.c), CUPTI never loaded; 0: the precise one */
    int timing;                 /* ... with kernel durations from CUDA event pairs (events.c); 0 under
                                 * OTEL_GPU_CENSUS_ACTIVITY=off: no duration measured */
    uint32_t events_every_eager, events_every_graph;   /* OTEL_GPU_CENSUS_EVENT_EVERY */
    int events_gate;            /* OTEL_GPU_CENSUS_EVENT_GATE=on (default): pairs gated (events.c) */
};
int gc_config_disabled(void);
void gc_config_load(struct gc_config *c);

/* graphs.c: the contents of graph launches, learned from their graphs (needs the v2 API's callbacks). */
/* 0: graph launches can be counted from their contents (learned through CUPTI's callbacks when by_cupti,
 * else from what interpose.c reports through the four calls below) */
int gc_graphs_start(void);                               /* 0: learning (the tables made, the driver's queries found) */
void gc_graphs_stop(void);
void gc_graphs_learn(CUgraphExec exec, CUgraph graph);  /* instantiated, or updated from `graph` */
void gc_graphs_forget(CUgraphExec exec);                /* about to be destroyed */
void gc_graphs_changed(CUgraphExec exec);               /* a node changed in the exec: inexact from now */
void gc_graphs_launch(CUgraphExec exec, uint32_t corr); /* launched under `corr` (before the call) */
int gc_graphs_contents(uint32_t corr, gc_graph_contents *out);   /* -1: not known */
/* copy_class.c: a copy's direction and host memory kind (enum gc_dir, gc_mem) from its two ends as the driver knows
 * their pointers (CU_MEMORYTYPE_UNIFIED: asked of the driver); after gc_copy_class_start() succeeded (0). */
int gc_copy_class_start(void);
void gc_copy_class(CUmemorytype src_type, const void *src_host, CUdeviceptr src_dev,
                   CUmemorytype dst_type, const void *dst_host, CUdeviceptr dst_dev, int *dir, int *mem, int *peer_dev);

/* graphs.c, for events.c: timed launches (our correlation ids) and their measured spans, which
 * price every launch of the same exec version (gc_graphs_contents fills span_ns). */
int gc_graphs_timed_start(void);
void gc_graphs_timed_launch(CUgraphExec exec, uint32_t corr);
void gc_graphs_timed_span(uint32_t corr, uint64_t ns);
int gc_graphs_span_wanted(CUgraphExec exec, uint32_t min); /* its version has fewer than min spans */

/* events.c: kernel durations from CUDA event pairs around about 1 of every `every_eager` eager and `every_graph` graph
 * launches of a thread (OTEL_GPU_CENSUS_ACTIVITY=events, the census library preloaded; interpose.c's wrappers call
 * before and after the driver's launch, the flusher polls). */
struct gc_event_sample { uint32_t dev; uint64_t t_ns, ns; };   /* an eager launch's: when (census clock), how long */
struct gc_events_stats { uint32_t every_eager, every_graph, gate; uint64_t timed, missed, failed, idle, idle_ns, gated, forced, lead, lead_ns; };
int gc_events_start(uint32_t every_eager, uint32_t every_graph, int gate);   /* libcuda loaded: 0, else -1 (one line) */
int gc_events_tick(const void *exec); /* this launch of the thread is one of the sample (every launch asks);
                                        exec: a graph launch's, NULL an eager launch */
int gc_events_before(CUstream s, CUcontext c, int dev, uintptr_t key, int graph); /* key: function or exec; slot, -1 */
void gc_events_after(int slot, CUstream s, int ok, uint32_t corr, int dev); /* corr: a graph launch's, else 0 */
size_t gc_events_poll(struct gc_event_sample *out, size_t max);   /* the flusher's: pairs done; eager ones to out */
void gc_events_context_going(int is_ctx, uintptr_t v);  /* before cuCtxDestroy(v), or device v's primary release */
void gc_events_stop(int at_exit);
void gc_events_forget(void);        /* a forked child */
void gc_events_stats(struct gc_events_stats *out);
#define GC_EVENTS_MAX_PENDING (8 * 256)   /* pairs outstanding at most: a poll's eager samples fit in this */

/* steps.c: the calling thread's step stack, and correlation id -> step for the tally. */
/* the table made and `follow` (NULL: nothing to turn on) run, once; 0 when steps can be tagged */
int gc_steps_start(int (*follow)(void));
/* the collector's per-step marks, called with the stack's depth before a push and before a pop (and the step) */
void gc_steps_marks(void (*push)(uint32_t depth), void (*pop)(uint32_t depth, uint32_t id));
#define GC_STEP_DEPTH 8
int gc_steps_push(uint64_t id);
int gc_steps_pop(uint64_t *id);
uint64_t gc_steps_lookup(uint32_t corr);    /* 0: not launched inside a step (or forgotten) */
int gc_steps_in_use(void);
void gc_steps_note(uint32_t corr);  /* interpose.c: a call under correlation id `corr` belongs to the open step */

/* interpose.c: the driver's calls seen through this library preloaded (no CUPTI). */
int gc_interpose_ready(void);       /* driver functions were handed out as our wrappers, or our exports called */
void gc_interpose_unseen(gc_segment *seg);   /* work we could not size: unsized_calls, unwrapped (under the lock) */
void gc_interpose_start(void);      /* the wrappers report from now on */
void gc_interpose_stop(void);       /* ... no longer (a forked child) */
int gc_interpose_on(void);

/* launches.c: eager kernel launches counted by the library preloaded (interpose.c); the fold needs the writer's lock. */
int gc_launches_start(int64_t gpu_minus_mono);  /* 0 when counted */
void gc_launches_set_counting(int on);          /* off while the census is paused, or in a forked child */
void gc_launches_step_push(uint32_t depth);     /* per-step marks of this thread's launches (gc_steps_marks) */
void gc_launches_step_pop(uint32_t depth, uint32_t id);
int gc_launches_pending(void);                  /* launches counted that no fold took yet */
void gc_launches_fold(gc_tally *t, gc_segment *seg, uint64_t mono_now);
/* whether a launch on `stream` only records into a capture; for interpose.c: one eager launch on `dev` (-1:
 * unknown) while counting; a capture begun (ok: it succeeded) or ended */
int gc_launches_capturing(CUstream stream);
void gc_launches_count(int dev);
int gc_launches_counting(void);
void gc_launches_capture(int begin, int ok);
int gc_launches_any_capture(void);              /* a capture is open somewhere in the process (events.c) */

/* calls.c: copies, memsets and graph launches counted at their calls by the library preloaded; the fold needs the
 * writer's lock. */
int gc_calls_start(int64_t gpu_minus_mono);      /* 0 when every copy and memset call is followed */
/* for interpose.c: the index of a driver call calls.c reads (its name without _ptds/_ptsz; -1: none), and
 * one such call that succeeded, its parameters laid out as CUPTI passes them (call_params.h) */
int gc_calls_index(const char *name);
void gc_calls_note(int index, int per_thread, const void *params, int dev, uint32_t corr);
void gc_calls_set_counting(int on);
int gc_calls_pending(void);
void gc_calls_fold(gc_tally *t, gc_segment *seg);

/* managed.c: managed memory made, advised, prefetched and freed, per device, from the calls' parameters (laid out as
 * CUPTI's, managed_params.h): the default collector's wrappers and the precise collector's callbacks both report here. */
enum { GC_M_NONE = 0, GC_M_ALLOC, GC_M_POOL_ALLOC, GC_M_FREE, GC_M_ADVISE, GC_M_ADVISE2, GC_M_PREFETCH, GC_M_PREFETCH2,
       GC_M_PREFETCH_BATCH };
int gc_managed_call(int call, const void *params, int dev);   /* a call that succeeded, on device `dev` (-1: unknown) */
void gc_managed_alloc(int dev, uint64_t ptr, uint64_t bytes);
void gc_managed_free(uint64_t ptr);
int gc_managed_any(void);                       /* a managed allocation was made */
int gc_managed_pending(void);                   /* calls counted since the last publish */
void gc_managed_publish(gc_segment *seg);       /* the counts into the segment (under the writer's lock) */
/* The driver callback ids the precise collector follows, and which call each is (GC_M_NONE: not one). */
int gc_managed_cbid(CUpti_CallbackId cbid);

/* log.c: one line to stderr, prefixed, never more than once per reason id. */
/* contexts.c: the kernel kind switched per context (CUPTI loses eager kernel records when it is
 * switched globally) */
void gc_contexts_add(CUcontext ctx);            /* a context to switch from now on (NULL: ignored) */
void gc_contexts_remove(CUcontext ctx);         /* going away: never switched again */
int gc_contexts_known(CUcontext ctx);
int gc_contexts_switch(int on, int only_new, int global_on);   /* contexts switched (or already so), -1: CUPTI refused */
uint64_t gc_contexts_full(void);                /* contexts not kept (more than 64) */
int gc_contexts_new(void);                      /* contexts not yet given a state */
void gc_contexts_forget(void);                  /* in a forked child */

/* thread.c: a thread of the census's own, detached, every signal blocked, on `stack` bytes (the default where
 * refused); 0, else -1 with one line: "cannot start the `what`: why". */
int gc_thread_start(void *(*fn)(void *), size_t stack, const char *what);
void gc_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* segment.c */
struct gc_segment;
/* Create and map this process's segment in the census folder; NULL (and a log line) on failure. */
struct gc_segment *gc_segment_open(char *path_out, size_t path_len);
uint64_t gc_wall_ns(void);
uint64_t gc_mono_ns(void);      /* CLOCK_MONOTONIC: what launches and calls are placed by, what the flusher sleeps on */

#endif
