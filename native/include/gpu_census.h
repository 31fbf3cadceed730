/*
 * gpu_census.h - the one contract between the native injector and its readers.
 *
 * A census segment is a file, one per CUDA process, mapped shared by the writer (the
 * injector inside the server) and read by anyone (the otel-gpu-census reader, through cffi).
 * It follows perf_event_mmap_page: fixed-width fields, an explicit layout version, a sequence
 * counter that is odd while the writer updates, and readers that copy and retry. A reader never
 * blocks the writer. A writer that dies mid-update leaves `seq` odd: readers then know the copy
 * may be torn and say so, and the totals are still the last values written.
 *
 * Three views of the same records:
 *   - devices[]: running totals per CUDA device since the process started;
 *   - windows[]: a ring of fixed time buckets (GPU timestamps), so a reader can ask "what ran
 *     between t0 and t1" exactly, whenever the records arrive (CUPTI delivers them late);
 *   - steps[]:   a ring keyed by step id, the id that gc_step_begin() pushed on the thread that
 *     launched the work, so engine hooks attribute GPU work to their steps.
 *
 * Layout rules: only fixed-width types, every struct a multiple of 8 bytes, no pointers; sizes are
 * asserted below. Bump GC_LAYOUT_VERSION on any change; readers refuse other versions.
 */
#ifndef GPU_CENSUS_H
#define GPU_CENSUS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GC_MAGIC            0x53534e4355504743ULL /* "CGPUCNSS" read as little-endian bytes */
#define GC_LAYOUT_VERSION   5u
#define GC_MAX_DEVICES      16u
#define GC_WINDOW_SLOTS     2048u                 /* power of two */
#define GC_WINDOW_NS        20000000ull           /* 20 ms buckets: 2048 of them hold ~41 s */
#define GC_STEP_SLOTS       1024u                 /* power of two */
#define GC_COMM_LEN         64u
#define GC_NOTE_LEN         192u

/* Copy direction (from CUPTI's copyKind; arrays count as device memory). */
enum gc_dir {
    GC_DIR_HTOD = 0,   /* host -> device */
    GC_DIR_DTOH = 1,   /* device -> host */
    GC_DIR_DTOD = 2,   /* within one device */
    GC_DIR_PTOP = 3,   /* device -> another device */
    GC_DIR_HTOH = 4,   /* host -> host through the driver */
    GC_DIR_OTHER = 5,  /* unknown copyKind */
    /* Managed (unified) memory the driver migrated on its own, no copy call naming it (page faults, prefetches,
     * evictions): CUPTI's unified-memory counters, the precise collector only. Host memory kind OTHER; counted on the
     * device the pages went to (HTOD) or came from (DTOH), in windows by start, never in steps (no correlation id). */
    GC_DIR_MANAGED_HTOD = 6,
    GC_DIR_MANAGED_DTOH = 7,
    GC_NDIR = 8
};

/* The host side of a copy (src for HtoD and HtoH, dst for DtoH); DEVICE when neither side is host. */
enum gc_mem {
    GC_MEM_PAGEABLE = 0,
    GC_MEM_PINNED = 1,
    GC_MEM_DEVICE = 2,
    GC_MEM_OTHER = 3,  /* managed or unknown */
    GC_NMEM = 4
};

/* Segment state. */
enum gc_state {
    GC_STATE_ACTIVE = 1,   /* writer alive and counting */
    GC_STATE_EXITED = 2    /* final flush done (at exit, or gc_finish): totals are complete */
};

/* Which collector wrote the segment (OTEL_GPU_CENSUS_COLLECTOR), fixed at start. Copies, memsets and kernel counts
 * are exact under both; they differ in what is timed. */
enum gc_collector {
    GC_COLLECTOR_PRECISE = 0,  /* CUPTI's records of every kernel, copy and memset from cuInit on: measured durations
                                  and busy time */
    GC_COLLECTOR_DEFAULT = 1   /* the library preloaded: every launch, copy and memset counted at its call (eager
                                  launches in eager_launches, graph launches from their contents); kernel time
                                  estimated from CUDA event pairs around a sample of the launches (gc_timing): eager
                                  kernels at the sample's mean, graph launches at their exec's mean span. Copy and
                                  memset durations and busy time not measured (0). CUPTI never loaded */
};

/* Flags, cumulative. */
/* 0x1 is unused: no cheap, exact signal tells the injector that another CUPTI client took over */
#define GC_FLAG_DROPPED         0x2u  /* CUPTI dropped records (buffers refused or full) */
#define GC_FLAG_RING_OVERRUN    0x4u  /* a window or step slot was reused before readers could see it */
#define GC_FLAG_GRAPH_LAUNCHES  0x8u  /* graphs reported per launch (GRAPH_TRACE) rather than per node */
#define GC_FLAG_GRAPH_INEXACT   0x10u /* graph launches of unknown or inexact contents (graph_unknown/_inexact) */
/* 0x20 to 0x100 are unused: they named retired ways of counting (the collector says how now) */
/* Managed (unified) memory: allocations made in the process (both collectors, at the calls). What the driver then
 * migrates is named by no copy call: only CUPTI's unified-memory counters measure it (GC_DIR_MANAGED_*).
 * MANAGED: managed memory was allocated (or migrated) in the process. UM_COUNTERS: the precise collector has CUPTI's
 * unified-memory counters on, migrations measured from um_since_wall_ns. UM_REFUSED: it asked for them and CUPTI or
 * the driver refused (um_refused_code): migrations not measured. */
#define GC_FLAG_MANAGED         0x200u
#define GC_FLAG_UM_COUNTERS     0x400u
#define GC_FLAG_UM_REFUSED      0x800u
/* The process started with GGML_CUDA_ENABLE_UNIFIED_MEMORY set (llama.cpp's CUDA backend then allocates its buffers
 * as managed memory): what a report names as the setting behind the migrations. */
#define GC_FLAG_ENV_UNIFIED     0x1000u

/* How CUDA graphs are counted (OTEL_GPU_CENSUS_GRAPHS). */
enum gc_graphs {
    GC_GRAPHS_NODE = 0,      /* one CUPTI record per node of every launch (CUPTI's cost per node) */
    GC_GRAPHS_LAUNCH = 1     /* one record per launch; its kernels, copies and memsets learned from the
                                graph once (graphs.c): exact counts and bytes, kernel time = graph span */
};

typedef struct gc_stat {
    uint64_t count;
    uint64_t bytes;
    uint64_t ns;       /* summed durations (end - start) */
} gc_stat;

/* Managed memory of one device in one process. Calls are counted by both collectors; the rest are CUPTI's
 * unified-memory counters (precise collector, GC_FLAG_UM_COUNTERS), 0 otherwise. */
typedef struct gc_managed {
    uint64_t allocs;            /* managed allocations made on this device's context (cuMemAllocManaged, managed pools) */
    uint64_t alloc_bytes;       /* ... their bytes */
    uint64_t live_bytes;        /* ... not freed yet (frees of allocations the census could not follow: never taken off) */
    uint64_t advises;           /* cuMemAdvise calls on this device's context */
    gc_stat  prefetch_in;       /* prefetches to this device: calls, bytes asked (pages already there do not move), 0 ns */
    gc_stat  prefetch_out;      /* ... to the host, from this device's context */
    gc_stat  migrated_dtod;     /* CUPTI: migrations to this device from another device (records, bytes, ns) */
    uint64_t gpu_faults;        /* CUPTI: GPU page fault groups (GPU_PAGE_FAULT values summed) */
    uint64_t thrashing;         /* CUPTI: thrashing reports naming this device */
    uint64_t throttling;        /* CUPTI: throttling reports */
    uint64_t remote_maps;       /* CUPTI: remote maps to this device instead of migrations */
} gc_managed;

typedef struct gc_device {
    uint32_t device_id;         /* CUDA device ordinal, as CUPTI reports it */
    uint32_t in_use;            /* 1 once a record for this device was seen */
    uint8_t  uuid[16];          /* filled when CUPTI reports the device; zero if unknown */
    uint64_t kernel_count;
    uint64_t kernel_ns;         /* summed kernel durations: concurrent kernels add up */
    uint64_t busy_ns;           /* union of kernel intervals: concurrent kernels count once */
    uint64_t first_ns;          /* earliest start seen (CUPTI timestamp, ns) */
    uint64_t last_ns;           /* latest end seen */
    uint64_t graph_launches;    /* GRAPH_TRACE records: one per graph launch */
    uint64_t graph_ns;          /* their spans (first node's start to last node's end) */
    gc_stat  copy[GC_NDIR][GC_NMEM];  /* PTOP: sent by this device */
    gc_stat  memset;
    gc_stat  peer_recv;               /* peer copies received from other devices */
    uint64_t graph_kernel_count;      /* of kernel_count: kernels counted from graph launches' contents */
    /* Eager (non-graph) kernels. DEFAULT: kernel_count = eager_launches + graph_kernel_count (exact), and
     * kernel_ns = graph spans + the durations of the eager_traced samples. PRECISE: kernel_count counts records
     * (eager_traced of them eager), eager_launches stays 0. */
    uint64_t eager_launches;          /* launches counted at their calls (DEFAULT) */
    uint64_t eager_traced;            /* eager kernels timed: every record (PRECISE), the event pairs (DEFAULT) */
    uint64_t eager_traced_ns;         /* their summed durations (part of kernel_ns) */
    gc_managed managed;               /* managed memory: copy[GC_DIR_MANAGED_*] holds what migrated */
} gc_device;

/* One time bucket: everything that *started* in [index*GC_WINDOW_NS, (index+1)*GC_WINDOW_NS).
 * Durations are split across the buckets they span; counts and bytes go to the start bucket. */
typedef struct gc_window {
    uint64_t index;             /* timestamp / GC_WINDOW_NS; 0 means empty */
    uint64_t kernel_count;
    uint64_t kernel_ns;
    gc_stat  copy[GC_NDIR];
    gc_stat  memset;
    uint64_t eager_launches;    /* as in gc_device; placed by launch time (the CPU's clock mapped onto
                                   CUPTI's), not by the kernel's start on the GPU */
    uint64_t eager_traced;
    uint64_t eager_traced_ns;
    uint64_t device_mask;       /* bit d set when device d had activity (last: readers rely on it) */
} gc_window;

/* GPU work launched between gc_step_begin(id) and gc_step_end() on one thread. */
typedef struct gc_step {
    uint64_t id;                /* external correlation id; 0 means empty */
    uint64_t kernel_count;
    uint64_t kernel_ns;
    uint64_t first_ns;
    uint64_t last_ns;
    gc_stat  copy[GC_NDIR];
    gc_stat  memset;
    uint64_t eager_launches;    /* as in gc_device: launched between begin and end (deposited at end) */
    uint64_t eager_traced;
    uint64_t eager_traced_ns;
    uint64_t device_mask;       /* (last: readers rely on it) */
} gc_step;

/* The default collector's timing sample: CUDA event pairs around about 1 of every every_eager eager and every_graph
 * graph launches of a thread (random gaps; EAGER 0: eager kernels untimed), and every launch of a graph exec until 8 of
 * its launches are timed. on 0: no pair was ever set up (the events could not start): kernel time not measured. */
typedef struct gc_timing {
    uint32_t on;                /* 1: event pairs time the sample */
    uint32_t gate;              /* 1: each pair's stream waited for its launch to be submitted (OTEL_GPU_CENSUS_EVENT_GATE) */
    uint32_t every_eager;
    uint32_t every_graph;
    uint64_t timed;             /* pairs read */
    uint64_t missed;            /* launches of the sample left untimed: no free pair, no pool for their context */
    uint64_t failed;            /* pairs an event call failed for (creating, recording, reading) */
    uint64_t idle;              /* eager pairs whose first event fired before their launch call returned (the stream
                                   was idle: they read long): not the eager sample */
    uint64_t idle_ns;           /* ... their durations from the call's return, summed */
    uint64_t gated;             /* pairs whose stream waited for their launch to be submitted */
    uint64_t forced;            /* ... whose gate the watchdog opened, its thread held up (dropped, not timed) */
    uint64_t lead;              /* gated eager pairs read with an event just before their first: the GPU's pass over
                                   one event, taken off each such pair's duration (the eager sample holds the rest) */
    uint64_t lead_ns;           /* ... those passes, summed */
} gc_timing;

typedef struct gc_segment {
    /* identity: written once before the segment is published */
    uint64_t magic;
    uint32_t layout_version;
    uint32_t segment_size;      /* sizeof(gc_segment) */
    uint32_t pid;
    uint32_t ppid;
    uint64_t proc_start_ticks;  /* /proc/<pid>/stat starttime: tells a reused pid apart */
    uint64_t wall_start_ns;     /* CLOCK_REALTIME when CUDA initialised the census (cuInit) */
    uint64_t clock_ref_gpu_ns;  /* a CUPTI timestamp ... */
    uint64_t clock_ref_wall_ns; /* ... and CLOCK_REALTIME read at the same moment */
    uint32_t cupti_version;     /* cuptiGetVersion() */
    uint32_t window_ns_div;     /* GC_WINDOW_NS / 1000 (microseconds), so readers need no constant */
    char     comm[GC_COMM_LEN]; /* program name (argv[0] basename) */

    /* live part: changed only between seq going odd and going even again */
    volatile uint64_t seq;
    uint64_t wall_update_ns;    /* CLOCK_REALTIME of the last publish */
    uint32_t state;             /* enum gc_state */
    uint32_t flags;             /* GC_FLAG_* */
    uint64_t records;           /* activity records tallied */
    uint64_t records_unknown;   /* records of kinds the census does not count */
    uint64_t dropped;           /* records CUPTI reported dropped */
    uint64_t buffers;           /* buffers completed */
    uint64_t buffers_refused;   /* buffer requests refused to stay under the memory bound */
    uint64_t step_unmatched;    /* records whose launch had no external id recorded (yet) */
    uint64_t window_late;       /* records older than the window ring: in totals, not in windows */
    uint64_t step_max;          /* largest step id a record was tallied for (not launch counts: they come
                                   ahead of the records, and the settler waits on this for them) */
    uint64_t last_gpu_ns;       /* latest CUPTI end timestamp seen, all devices */
    uint64_t complete_wall_ns;  /* CLOCK_REALTIME at the start of the last completed flush: GPU work
                                   that finished before it is in the totals (0: not known yet) */
    /* Work the census knows it could not count: never silent. Were reserved: older writers leave them 0. */
    uint64_t unsized_calls;     /* calls of driver functions that put work on the GPU but that the census has no
                                   wrapper for (a driver newer than the census): counted, not sized, in no total */
    uint64_t unwrapped;         /* such functions handed out with no way to count their calls (every counting
                                   slot taken, or no trampolines on this CPU): their calls are not even counted */
    char     unsized_name[48];  /* the first such function's name (NUL-terminated), for the one line that says so */
    uint64_t um_cpu_faults;     /* CUPTI's CPU page faults on managed memory (a record each; no device named) */
    uint32_t collector;         /* enum gc_collector, fixed at start */
    uint32_t contexts_late;     /* PRECISE: contexts created after CUPTI was set up (all of them: it is set up in
                                   cuInit; their graph replays pay CUPTI's per-node cost) */
    uint32_t graph_mode;        /* enum gc_graphs now in force */
    uint32_t paused;            /* 1 while a control file has the census paused (nothing traced) */
    uint64_t graph_unknown;     /* graph launches whose contents were not known (only their span counted) */
    uint64_t graph_inexact;     /* graph launches with conditional or changed nodes (counts are a floor) */
    uint64_t paused_ns;         /* CLOCK_MONOTONIC ns the census was paused, as of complete_wall_ns */
    uint64_t launches_lost;     /* DEFAULT: launches counted but not placed (device unknown, a step's count
                                   overwritten before it was folded); in no total */
    uint64_t calls_lost;        /* DEFAULT: copies, memsets and graph launches seen at their calls but in no total
                                   (the queue to the flusher full, a call whose size could not be read) */
    uint64_t graph_untimed;     /* DEFAULT with timing on: graph launches counted with no span to price them (no
                                   launch of their exec, nor of any graph, was timed yet): in kernel counts, not in
                                   kernel_ns */
    uint64_t um_since_wall_ns;  /* GC_FLAG_UM_COUNTERS: CLOCK_REALTIME when they went on (0: never) */
    uint32_t um_refused_code;   /* GC_FLAG_UM_REFUSED: CUPTI's result code */
    uint32_t um_pad;
    gc_timing timing;           /* DEFAULT: the event-pair sample; all 0 under PRECISE */

    gc_device devices[GC_MAX_DEVICES];
    gc_window windows[GC_WINDOW_SLOTS];
    gc_step   steps[GC_STEP_SLOTS];
} gc_segment;

/* ---- C API inside the censused process (resolve with dlsym; all are no-ops when off) ---- */

/* Layout version this library writes. */
uint32_t gc_layout_version(void);
/* 1 while the census counts in this process, else 0. */
int gc_active(void);
/* Tally the GPU work this thread launches from now on under step `id` (0 < id < 2^32): kernels,
 * graph launches (each node's work), copies and memsets launched by this thread until gc_step_end.
 * The first call turns CUPTI's launch callbacks on (under the v1 API that takes CUPTI's one
 * subscriber slot). Returns 0 on success, -1 when the census is off or steps cannot be tagged.
 * Steps nest per thread (push/pop, 8 deep). */
int gc_step_begin(uint64_t id);
/* End the innermost step of this thread; writes its id to *id when id is not NULL. */
int gc_step_end(uint64_t *id);
/* Have CUPTI hand its completed buffers to the census now (not forced: records of work still
 * running stay in CUPTI); 0 on success. */
int gc_flush(void);
/* The final flush now, as at exit: forced, totals complete, state EXITED; the census stops
 * counting in this process. For servers that end without running atexit handlers (vLLM's engine
 * process). 0 on success, -1 when the census was not counting. */
int gc_finish(void);
/* Path of this process's segment, or "" when none was created yet. */
const char *gc_segment_path(void);

/* ---- The tally: pure record arithmetic, no CUDA needed (tests feed it real CUPTI records) ---- */

/* What one launch of a CUDA graph puts on the GPU, learned from its nodes (not part of the segment). */
#define GC_GRAPH_INEXACT 0x1u  /* conditional nodes, or nodes changed in the exec after instantiation */
typedef struct gc_graph_contents {
    uint32_t kernels;           /* kernel nodes, child graphs included */
    uint32_t memsets;
    uint64_t memset_bytes;
    uint32_t copies[GC_NDIR][GC_NMEM];
    uint64_t copy_bytes[GC_NDIR][GC_NMEM];
    uint32_t flags;             /* GC_GRAPH_INEXACT */
    uint32_t span_from;         /* where span_ns comes from (GC_SPAN_*), read with the contents, never stored */
    uint64_t span_ns;           /* DEFAULT: the launch's estimated span (0: none) */
} gc_graph_contents;
enum { GC_SPAN_NONE = 0, GC_SPAN_EXEC = 1, GC_SPAN_ALL = 2 }; /* none; this exec's mean; all graphs' per kernel */

typedef struct gc_tally gc_tally;

/* Private writer state (busy-interval frontier, correlation map) bound to a segment. */
gc_tally *gc_tally_create(gc_segment *seg);
void gc_tally_destroy(gc_tally *t);
/* Count one CUPTI activity record (any CUpti_Activity*; unknown kinds are counted as such). */
void gc_tally_record(gc_tally *t, const void *record);
/* Count one GRAPH_TRACE record (CUpti_ActivityGraphTrace2) whose launch put `contents` on the GPU
 * (NULL: not known; only the span counts). gc_tally_record does this with the contents graphs.c
 * learned for the record's correlation id. */
void gc_tally_graph_launch(gc_tally *t, const void *record, const gc_graph_contents *contents);
/* DEFAULT: one API call's work, seen by its wrapper (no record, no duration), placed at t_ns on the census clock. */
enum gc_call_what { GC_CALL_COPY = 1, GC_CALL_MEMSET = 2, GC_CALL_GRAPH = 3 };
typedef struct gc_call {
    uint64_t t_ns;              /* when the call returned */
    uint64_t bytes;             /* COPY, MEMSET */
    uint32_t corr;              /* the call's CUPTI correlation id: its step; GRAPH: its graph's contents */
    uint8_t  what;              /* enum gc_call_what */
    uint8_t  dir, mem;          /* COPY: enum gc_dir, enum gc_mem */
    uint8_t  dev;               /* the calling context's device (PTOP: the sender) */
    uint8_t  peer_dev;          /* COPY of GC_DIR_PTOP: the receiving device */
    uint8_t  pad[3];
    uint32_t copies;            /* COPY: how many copies `bytes` sums (a batch's of one class); 0 means 1 */
} gc_call;
/* DEFAULT, timing on: one eager launch's duration `ns` from a CUDA event pair, launched at `t_ns` (census clock): the
 * eager sample of its device and 20 ms window; not busy (where it ran on the GPU is not known) */
void gc_tally_eager_sample(gc_tally *t, uint32_t dev, uint64_t t_ns, uint64_t ns);
/* Count one call: a copy or memset as a record of zero duration would be; a graph launch with
 * `contents` (NULL: not known) as gc_tally_graph_launch does for a GRAPH_TRACE record spanning 0 ns. */
void gc_tally_call(gc_tally *t, const gc_call *c, const gc_graph_contents *contents);
/* DEFAULT: `n` eager kernel launches counted at their calls, folded in by the injector under its lock: on device
 * `dev`; in the window holding census time `gpu_ns`; under step `id` (its device `dev`). Each adds to eager_launches,
 * and to kernel_count where the segment's collector is DEFAULT. */
void gc_tally_launches_device(gc_tally *t, uint32_t dev, uint64_t n);
void gc_tally_launches_window(gc_tally *t, uint64_t gpu_ns, uint64_t n);
void gc_tally_launches_step(gc_tally *t, uint64_t id, uint32_t dev, uint64_t n);
/* Fold private state (busy union) into the segment. Call inside a seq-odd section.
 * final != 0 commits every open interval (at exit: nothing more will arrive). */
void gc_tally_publish(gc_tally *t, int final);
/* Writer-side seqlock helpers. */
void gc_segment_begin_update(gc_segment *seg);
void gc_segment_end_update(gc_segment *seg);
/* Fill identity fields of a fresh segment (magic, version, pid, clocks, comm). wall_start_ns and
 * clock_ref_gpu_ns: when the census started (0: now) and the CUPTI timestamp read then (0: none). */
void gc_segment_init(gc_segment *seg, const char *comm, uint64_t wall_start_ns, uint64_t clock_ref_gpu_ns);

#ifdef __cplusplus
}
#endif
#endif /* GPU_CENSUS_H */
