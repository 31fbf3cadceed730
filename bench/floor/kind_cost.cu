/*
 * kind_cost.cu - what CUPTI costs per launch, for each activity kind / callback configuration and
 * each kind of launch, measured in ONE process.
 *
 * Why one process: separate processes (plain vs floor vs census) scattered +-25 % on eager launches,
 * far more than the differences between activity kinds. Here every configuration runs in the same
 * process, context and stream, in many short rounds; in round i the configurations run in an order
 * rotated by i (no configuration always goes first), and every configuration's figure is paired with
 * the `none` (nothing enabled) figure of the SAME round: delta = config - none, whose median and
 * p25/p75 over the rounds are the cost of that configuration.
 *
 * Configurations (CUPTI v1 API, as the census uses on this driver):
 *   none             nothing enabled (the baseline)
 *   cb               callbacks only: cuptiSubscribe once; cuptiEnableCallback for every runtime/driver
 *                    cbid named cudaLaunch* cudaGraphLaunch* cudaMemcpy* cudaMemset* / cuLaunch*
 *                    cuGraphLaunch* cuMemcpy* cuMemset*; the callback stores the correlation id
 *   copies           MEMCPY + MEMCPY2 + MEMSET
 *   kernel           CONCURRENT_KERNEL
 *   all              CONCURRENT_KERNEL + MEMCPY + MEMCPY2 + MEMSET (the census's per-node mode)
 *   graph            MEMCPY + MEMCPY2 + MEMSET + GRAPH_TRACE (graph launches traced per launch)
 *   graph+kernel     CONCURRENT_KERNEL + MEMCPY + MEMCPY2 + MEMSET + GRAPH_TRACE (census default)
 *   graph+kernel+cb  the previous plus the `cb` callbacks
 *   cb-launch        callbacks on the kernel launch calls only, runtime and driver (cudaLaunchKernel*,
 *                    cudaLaunchCooperativeKernel*, cuLaunchKernel*, cuLaunchCooperativeKernel*): what
 *                    the census's launch counting enabled until 2026-12-03
 *   cb-launch-driver the driver's of those only: what it keeps once the runtime's are proven redundant
 *   cb-paused        what a paused census keeps on: graph launches (runtime and driver), captures'
 *                    begin and end (runtime and driver), the driver's graph-exec updates and setters
 * --pristine N: N rounds (after one warm-up) before CUPTI is set up at all (no subscriber, no buffers):
 * the process as it is without a census. Not alternated with the rest (CUPTI cannot be taken out
 * again), so compared by medians, not paired: a drift of the host moves it too, and the `cpu` workload
 * (a fixed loop, no CUDA) says whether it did.
 * --after N: N rounds once the measured ones are done and CUPTI's subscriber is gone (cuptiUnsubscribe),
 * then N more after cuptiFinalize: does the tax leave with them?
 * --setup both|activity|subscribe: what "CUPTI set up" is: buffers registered and a subscriber (as the
 * census), the activity API alone (configurations with callbacks are skipped), or the subscriber alone
 * (configurations with kinds are skipped).
 * A configuration whose kinds CUPTI refuses is recorded (with CUPTI's error string) and skipped.
 *
 * Workloads (one cudaStreamNonBlocking stream), each timed with CLOCK_MONOTONIC:
 *   eager  N empty-kernel launches <<<1,32,0,s>>>, one synchronize: issue (launch calls) and total
 *          (to after the synchronize), ns per launch
 *   graph  a captured graph of K empty kernels + a 4 KiB D2H copy into pinned memory + a 4 KiB
 *          memset, instantiated inside the configuration (CUPTI instruments at instantiation),
 *          2 warm-up launches, then R launches and one synchronize: issue, total, GPU (cudaEvent
 *          pair) and instantiate, ns per node (R*(K+2) nodes; instantiate per K+2 nodes)
 *   copy   M 4 KiB cudaMemcpyAsync D2H into pinned memory, one synchronize: issue and total, ns per
 *          copy
 *   api    A rounds of the calls a framework makes around its launches (cudaGetDevice,
 *          cudaStreamIsCapturing, cudaEventRecord, cudaPeekAtLastError), none of them a callback of
 *          any configuration: ns per round of four (does CUPTI's presence tax the calls it does not trace?)
 * Enabling, disabling and cuptiActivityFlushAll(FORCED) happen outside the timed regions.
 *
 * Build: make -C bench/floor kind_cost [BUILD=...] [CUPTI_INCLUDE_DIR=...] [CUPTI_LIB_DIR=...]
 * Run:   kind_cost [--rounds 21] [--eager-n 10000] [--graph-k 1000] [--graph-r 10] [--copy-m 2000]
 *                  [--configs a,b,c] [--budget-s 50] [--out kind_cost.json]
 * Exit:  0 done, 1 bad arguments, 2 no usable GPU, 3 a CUDA/CUPTI error or the output not written.
 */
#include <cuda_runtime.h>
/* Not <cupti.h>: it pulls in generated_cuda*_meta.h, which need the cuda.h of CUPTI's own CUDA
 * version (13.5 in the wheel) and fail against nvcc 13.0's. These need only long-stable types. */
#include <cupti_activity.h>
#include <cupti_callbacks.h>
#include <cupti_driver_cbid.h>
#include <cupti_result.h>
#include <cupti_runtime_cbid.h>
#include <cupti_version.h>

#include <dlfcn.h>

#include <atomic>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#define CK(call)                                                                                  \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "kind_cost: CUDA error %s (%s) at line %d: %s\n",                     \
                    cudaGetErrorName(e_), cudaGetErrorString(e_), __LINE__, #call);               \
            exit(3);                                                                              \
        }                                                                                         \
    } while (0)

static const char *cupti_str(CUptiResult r)
{
    const char *s = nullptr;
    if (cuptiGetResultString(r, &s) != CUPTI_SUCCESS || !s) return "CUPTI_ERROR_(unknown)";
    return s;
}

#define CKP(call)                                                                                 \
    do {                                                                                          \
        CUptiResult r_ = (call);                                                                  \
        if (r_ != CUPTI_SUCCESS) {                                                                \
            fprintf(stderr, "kind_cost: CUPTI error %s at line %d: %s\n", cupti_str(r_),          \
                    __LINE__, #call);                                                             \
            exit(3);                                                                              \
        }                                                                                         \
    } while (0)

__global__ void empty() {}
__global__ void write_one(int *p, int v)
{
    if (threadIdx.x == 0) *p = v;
}

static inline int64_t now_ns()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ------------------------------------------------------------------ errors (non-fatal) */
static std::vector<std::string> g_errors;
static void note_error(const std::string &e)
{
    for (const std::string &x : g_errors)
        if (x == e) return;
    g_errors.push_back(e);
    fprintf(stderr, "kind_cost: %s\n", e.c_str());
}

/* ------------------------------------------------------------------ activity buffers */
static const int KMAX = 128, MAXCFG = 16;
static const size_t BUF_BYTES = 8u * 1024u * 1024u;
static std::atomic<int> g_cur_slot{MAXCFG};               /* MAXCFG = warm-up / unattributed */
static std::atomic<unsigned long long> g_rec[MAXCFG + 1][KMAX + 1]; /* [slot][kind], KMAX = other */
static std::atomic<unsigned long long> g_dropped[MAXCFG + 1];
static std::atomic<unsigned long long> g_buffers{0}, g_buffer_nulls{0};

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records)
{
    void *p = malloc(BUF_BYTES); /* malloc aligns to 16, CUPTI needs 8 */
    *buffer = (uint8_t *)p;
    *size = p ? BUF_BYTES : 0;
    *max_records = 0;
    if (!p) g_buffer_nulls.fetch_add(1);
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream_id, uint8_t *buffer,
                                      size_t size, size_t valid)
{
    (void)size;
    int slot = g_cur_slot.load();
    if (slot < 0 || slot > MAXCFG) slot = MAXCFG;
    if (buffer && valid) {
        unsigned long long counts[KMAX + 1] = {0};
        CUpti_Activity *rec = nullptr;
        while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
            unsigned k = (unsigned)rec->kind;
            counts[k < (unsigned)KMAX ? k : (unsigned)KMAX]++;
        }
        for (int k = 0; k <= KMAX; k++)
            if (counts[k]) g_rec[slot][k].fetch_add(counts[k]);
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream_id, &dropped) == CUPTI_SUCCESS && dropped)
        g_dropped[slot].fetch_add(dropped);
    g_buffers.fetch_add(1);
    free(buffer);
}

static const char *kind_name(int k)
{
    switch (k) {
    case CUPTI_ACTIVITY_KIND_MEMCPY: return "MEMCPY";
    case CUPTI_ACTIVITY_KIND_MEMSET: return "MEMSET";
    case CUPTI_ACTIVITY_KIND_KERNEL: return "KERNEL";
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: return "CONCURRENT_KERNEL";
    case CUPTI_ACTIVITY_KIND_MEMCPY2: return "MEMCPY2";
    case CUPTI_ACTIVITY_KIND_GRAPH_TRACE: return "GRAPH_TRACE";
    case CUPTI_ACTIVITY_KIND_RUNTIME: return "RUNTIME";
    case CUPTI_ACTIVITY_KIND_DRIVER: return "DRIVER";
    case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: return "EXTERNAL_CORRELATION";
    default: return nullptr;
    }
}

/* ------------------------------------------------------------------ callbacks */
static thread_local volatile uint32_t t_last_corr;
static thread_local unsigned long long t_cb_enter;

static void CUPTIAPI on_callback(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                                 const void *cbdata)
{
    (void)userdata; (void)domain; (void)cbid;
    const CUpti_CallbackData *d = (const CUpti_CallbackData *)cbdata;
    if (d->callbackSite == CUPTI_API_ENTER) {
        t_last_corr = d->correlationId;
        t_cb_enter++;
    }
}

struct Cbid {
    CUpti_CallbackDomain domain;
    CUpti_CallbackId id;
    std::string name;
    bool launch;   /* a kernel launch call */
    bool paused;   /* one a paused census keeps on (graph launches, captures, graph-exec changes) */
    bool work;     /* one of `cb`'s: launch, graph launch, copy or memset */
};
enum { CB_NONE = 0, CB_ALL, CB_LAUNCH, CB_LAUNCH_DRIVER, CB_PAUSED };
static bool in_set(const Cbid &c, int set)
{
    return (set == CB_ALL && c.work) || (set == CB_LAUNCH && c.launch) ||
           (set == CB_LAUNCH_DRIVER && c.launch && c.domain == CUPTI_CB_DOMAIN_DRIVER_API) ||
           (set == CB_PAUSED && c.paused);
}
static CUpti_SubscriberHandle g_sub;
static bool g_sub_ok;
static std::string g_sub_err;
static std::vector<Cbid> g_cbids;

static bool has_prefix(const char *s, const char *const *prefixes)
{
    for (; *prefixes; prefixes++)
        if (strncmp(s, *prefixes, strlen(*prefixes)) == 0) return true;
    return false;
}

static void collect_cbids()
{
    static const char *const rt[] = {"cudaLaunch", "cudaGraphLaunch", "cudaMemcpy", "cudaMemset",
                                     nullptr};
    static const char *const drv[] = {"cuLaunch", "cuGraphLaunch", "cuMemcpy", "cuMemset", nullptr};
    static const char *const rt_launch[] = {"cudaLaunchKernel", "cudaLaunchCooperativeKernel", nullptr};
    static const char *const drv_launch[] = {"cuLaunchKernel", "cuLaunchCooperativeKernel", nullptr};
    /* what native/src/graphs.c and launches.c keep on while the census is paused */
    static const char *const rt_paused[] = {"cudaGraphLaunch", "cudaStreamBeginCapture", "cudaStreamEndCapture",
                                            nullptr};
    static const char *const drv_paused[] = {"cuGraphLaunch", "cuStreamBeginCapture", "cuStreamEndCapture",
                                             "cuGraphExecUpdate", "cuGraphExecMemcpyNodeSetParams",
                                             "cuGraphExecMemsetNodeSetParams", "cuGraphExecNodeSetParams",
                                             "cuGraphExecChildGraphNodeSetParams", "cuGraphNodeSetEnabled", nullptr};
    for (uint32_t i = 1; i < (uint32_t)CUPTI_RUNTIME_TRACE_CBID_SIZE; i++) {
        const char *name = nullptr;
        if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, i, &name) != CUPTI_SUCCESS || !name)
            continue;
        if (has_prefix(name, rt) || has_prefix(name, rt_paused))
            g_cbids.push_back({CUPTI_CB_DOMAIN_RUNTIME_API, i, name, has_prefix(name, rt_launch),
                               has_prefix(name, rt_paused), has_prefix(name, rt)});
    }
    for (uint32_t i = 1; i < (uint32_t)CUPTI_DRIVER_TRACE_CBID_SIZE; i++) {
        const char *name = nullptr;
        if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, i, &name) != CUPTI_SUCCESS || !name)
            continue;
        if (has_prefix(name, drv) || has_prefix(name, drv_paused))
            g_cbids.push_back({CUPTI_CB_DOMAIN_DRIVER_API, i, name, has_prefix(name, drv_launch),
                               has_prefix(name, drv_paused), has_prefix(name, drv)});
    }
}

/* Keep only the cbids this CUPTI lets us enable (each enabled and disabled once); note the rest. */
static int g_cbids_refused;
static void probe_cbids()
{
    if (!g_sub_ok) return;
    std::vector<Cbid> ok;
    for (const Cbid &c : g_cbids) {
        CUptiResult r = cuptiEnableCallback(1, g_sub, c.domain, c.id);
        if (r == CUPTI_SUCCESS) r = cuptiEnableCallback(0, g_sub, c.domain, c.id);
        if (r == CUPTI_SUCCESS) {
            ok.push_back(c);
        } else {
            if (!g_cbids_refused)
                note_error("cuptiEnableCallback(" + c.name + "): " + cupti_str(r) +
                           " (cbid left out of the callback set)");
            g_cbids_refused++;
        }
    }
    g_cbids.swap(ok);
}

/* returns "" or the first error */
static std::string set_callbacks(uint32_t on, int set)
{
    std::string err;
    for (const Cbid &c : g_cbids) {
        if (!in_set(c, set)) continue;
        CUptiResult r = cuptiEnableCallback(on, g_sub, c.domain, c.id);
        if (r != CUPTI_SUCCESS && err.empty())
            err = std::string("cuptiEnableCallback(") + (on ? "1" : "0") + ", " + c.name +
                  "): " + cupti_str(r);
    }
    return err;
}

/* ------------------------------------------------------------------ configurations */
struct Config {
    const char *name;
    std::vector<CUpti_ActivityKind> kinds;
    int cb;   /* CB_*: which callbacks */
    bool per_ctx = false;   /* kinds enabled for the context (cuptiActivityEnableContext), not globally */
};
static CUcontext g_ctx;   /* the primary context, for the per-context configurations */
static const CUpti_ActivityKind K_KER = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
static const CUpti_ActivityKind K_CPY = CUPTI_ACTIVITY_KIND_MEMCPY;
static const CUpti_ActivityKind K_CPY2 = CUPTI_ACTIVITY_KIND_MEMCPY2;
static const CUpti_ActivityKind K_SET = CUPTI_ACTIVITY_KIND_MEMSET;
static const CUpti_ActivityKind K_GRAPH = CUPTI_ACTIVITY_KIND_GRAPH_TRACE;

static std::vector<Config> all_configs()
{
    return {
        {"none", {}, CB_NONE},
        {"cb", {}, CB_ALL},
        {"copies", {K_CPY, K_CPY2, K_SET}, CB_NONE},
        {"kernel", {K_KER}, CB_NONE},
        {"all", {K_KER, K_CPY, K_CPY2, K_SET}, CB_NONE},
        {"graph", {K_CPY, K_CPY2, K_SET, K_GRAPH}, CB_NONE},
        {"graph+kernel", {K_KER, K_CPY, K_CPY2, K_SET, K_GRAPH}, CB_NONE},
        {"graph+kernel+cb", {K_KER, K_CPY, K_CPY2, K_SET, K_GRAPH}, CB_ALL},
        {"cb-launch", {}, CB_LAUNCH},
        {"cb-launch-driver", {}, CB_LAUNCH_DRIVER},
        {"cb-paused", {}, CB_PAUSED},
        {"copies-ctx", {K_CPY, K_CPY2, K_SET}, CB_NONE, true},
        {"kernel-ctx", {K_KER}, CB_NONE, true},
    };
}

/* One of a configuration's kinds on or off: for its context, or globally. */
static CUptiResult kind_switch(const Config &c, CUpti_ActivityKind k, bool on)
{
    if (c.per_ctx) {
        if (!g_ctx) return CUPTI_ERROR_INVALID_CONTEXT;
        return on ? cuptiActivityEnableContext(g_ctx, k) : cuptiActivityDisableContext(g_ctx, k);
    }
    return on ? cuptiActivityEnable(k) : cuptiActivityDisable(k);
}

/* Enable a configuration. On failure: undo what was enabled, return the error. */
static std::string enable_config(const Config &c)
{
    size_t done = 0;
    std::string err;
    for (; done < c.kinds.size(); done++) {
        CUptiResult r = kind_switch(c, c.kinds[done], true);
        if (r != CUPTI_SUCCESS) {
            const char *kn = kind_name((int)c.kinds[done]);
            err = std::string("cuptiActivityEnable(") + (kn ? kn : "?") + "): " + cupti_str(r);
            break;
        }
    }
    if (err.empty() && c.cb) {
        if (!g_sub_ok)
            err = "cuptiSubscribe failed: " + g_sub_err;
        else
            err = set_callbacks(1, c.cb);
        if (!err.empty() && g_sub_ok) set_callbacks(0, c.cb);
    }
    if (!err.empty())
        for (size_t i = 0; i < done; i++) kind_switch(c, c.kinds[i], false);
    return err;
}

static void disable_config(const Config &c)
{
    for (CUpti_ActivityKind k : c.kinds) {
        CUptiResult r = kind_switch(c, k, false);
        if (r != CUPTI_SUCCESS) {
            const char *kn = kind_name((int)k);
            note_error(std::string(c.name) + ": cuptiActivityDisable(" + (kn ? kn : "?") +
                       "): " + cupti_str(r));
        }
    }
    if (c.cb && g_sub_ok) {
        std::string e = set_callbacks(0, c.cb);
        if (!e.empty()) note_error(std::string(c.name) + ": " + e);
    }
}

/* ------------------------------------------------------------------ workloads */
enum Metric {
    M_EAGER_ISSUE, M_EAGER_TOTAL,
    M_GRAPH_ISSUE, M_GRAPH_TOTAL, M_GRAPH_GPU, M_GRAPH_INST,
    M_COPY_ISSUE, M_COPY_TOTAL,
    M_API, M_CPU,
    M_COUNT
};
static const struct { const char *workload, *metric, *unit; } METRICS[M_COUNT] = {
    {"eager", "issue", "ns/launch"},  {"eager", "total", "ns/launch"},
    {"graph", "issue", "ns/node"},    {"graph", "total", "ns/node"},
    {"graph", "gpu", "ns/node"},      {"graph", "instantiate", "ns/node"},
    {"copy", "issue", "ns/copy"},     {"copy", "total", "ns/copy"},
    {"api", "issue", "ns/4 calls"},   {"cpu", "loop", "ns/loop"},
};

struct Params {
    int rounds = 21, eager_n = 10000, graph_k = 1000, graph_r = 10, copy_m = 2000, api_a = 5000, pristine = 0,
        after = 0;
    std::string setup = "both";
    double budget_s = 50.0;
    std::string out = "kind_cost.json";
    std::string configs;
};

struct Gpu {
    cudaStream_t s;
    cudaGraph_t graph;
    cudaEvent_t e0, e1;
    void *d_buf;
    void *h_pinned;
};

/* The graph of the graph workload. CUPTI learns a graph's nodes as they are made: a graph captured
 * before a kind was enabled gets no records of that kind (seen on the H200: no node records in the
 * per-node configuration), so each configuration captures its own, as a server under the census does. */
static void capture_graph(const Params &p, Gpu &g)
{
    CK(cudaStreamBeginCapture(g.s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < p.graph_k; i++) empty<<<1, 32, 0, g.s>>>();
    CK(cudaPeekAtLastError());
    CK(cudaMemcpyAsync(g.h_pinned, g.d_buf, 4096, cudaMemcpyDeviceToHost, g.s));
    CK(cudaMemsetAsync(g.d_buf, 0, 4096, g.s));
    CK(cudaStreamEndCapture(g.s, &g.graph));
}

static void run_workloads(const Params &p, Gpu &g, double *m /* [M_COUNT] */)
{
    /* eager */
    int64_t t0 = now_ns();
    for (int i = 0; i < p.eager_n; i++) empty<<<1, 32, 0, g.s>>>();
    int64_t t1 = now_ns();
    CK(cudaPeekAtLastError());
    CK(cudaStreamSynchronize(g.s));
    int64_t t2 = now_ns();
    m[M_EAGER_ISSUE] = (double)(t1 - t0) / p.eager_n;
    m[M_EAGER_TOTAL] = (double)(t2 - t0) / p.eager_n;

    /* graph: captured and instantiated here, inside the configuration */
    const double nodes = (double)(p.graph_k + 2);
    CK(cudaGraphDestroy(g.graph));
    capture_graph(p, g);
    cudaGraphExec_t exec = nullptr;
    t0 = now_ns();
    CK(cudaGraphInstantiate(&exec, g.graph, 0));
    t1 = now_ns();
    m[M_GRAPH_INST] = (double)(t1 - t0) / nodes;
    CK(cudaGraphLaunch(exec, g.s));
    CK(cudaGraphLaunch(exec, g.s));
    CK(cudaStreamSynchronize(g.s));
    CK(cudaEventRecord(g.e0, g.s));
    t0 = now_ns();
    for (int r = 0; r < p.graph_r; r++) CK(cudaGraphLaunch(exec, g.s));
    t1 = now_ns();
    CK(cudaEventRecord(g.e1, g.s));
    CK(cudaStreamSynchronize(g.s));
    t2 = now_ns();
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, g.e0, g.e1));
    m[M_GRAPH_ISSUE] = (double)(t1 - t0) / (p.graph_r * nodes);
    m[M_GRAPH_TOTAL] = (double)(t2 - t0) / (p.graph_r * nodes);
    m[M_GRAPH_GPU] = (double)ms * 1e6 / (p.graph_r * nodes);
    CK(cudaGraphExecDestroy(exec));

    /* copy */
    t0 = now_ns();
    for (int i = 0; i < p.copy_m; i++)
        CK(cudaMemcpyAsync(g.h_pinned, g.d_buf, 4096, cudaMemcpyDeviceToHost, g.s));
    t1 = now_ns();
    CK(cudaStreamSynchronize(g.s));
    t2 = now_ns();
    m[M_COPY_ISSUE] = (double)(t1 - t0) / p.copy_m;
    m[M_COPY_TOTAL] = (double)(t2 - t0) / p.copy_m;

    /* api: the calls around a framework's launches, none traced by any configuration */
    int dev = 0, errs = 0;
    cudaStreamCaptureStatus cs;
    t0 = now_ns();
    for (int i = 0; i < p.api_a; i++) {
        errs += cudaGetDevice(&dev) != cudaSuccess;
        errs += cudaStreamIsCapturing(g.s, &cs) != cudaSuccess;
        errs += cudaEventRecord(g.e0, g.s) != cudaSuccess;
        errs += cudaPeekAtLastError() != cudaSuccess;
    }
    t1 = now_ns();
    CK(cudaStreamSynchronize(g.s));
    if (errs) { fprintf(stderr, "kind_cost: %d api calls failed\n", errs); exit(3); }
    m[M_API] = (double)(t1 - t0) / p.api_a;

    /* cpu: no CUDA, the host's own speed (the control for comparisons that cannot alternate) */
    volatile uint64_t x = 1;
    t0 = now_ns();
    for (int i = 0; i < 200000; i++) x = x * 6364136223846793005ull + 1442695040888963407ull;
    t1 = now_ns();
    m[M_CPU] = (double)(t1 - t0);
}

/* n rounds of the workloads after one warm-up round, appended to out[metric] (the unpaired states:
 * before CUPTI is set up, after its subscriber left, after cuptiFinalize) */
static void unpaired_rounds(const Params &p, Gpu &g, int n, std::vector<std::vector<double>> &out)
{
    for (int rd = 0; rd <= n && n > 0; rd++) {
        double m[M_COUNT];
        run_workloads(p, g, m);
        if (rd > 0)
            for (int k = 0; k < M_COUNT; k++) out[k].push_back(m[k]);
    }
}

/* ------------------------------------------------------------------ statistics / output */
struct Stats {
    double median, p25, p75;
    int n;
};
static Stats stats_of(const std::vector<double> &v)
{
    std::vector<double> x;
    for (double d : v)
        if (std::isfinite(d)) x.push_back(d);
    Stats s{NAN, NAN, NAN, (int)x.size()};
    if (x.empty()) return s;
    std::sort(x.begin(), x.end());
    auto q = [&](double f) {
        double pos = f * (double)(x.size() - 1);
        size_t lo = (size_t)pos;
        size_t hi = std::min(lo + 1, x.size() - 1);
        return x[lo] + (x[hi] - x[lo]) * (pos - (double)lo);
    };
    s.median = q(0.5);
    s.p25 = q(0.25);
    s.p75 = q(0.75);
    return s;
}

static std::string jstr(const std::string &s)
{
    std::string o = "\"";
    for (char ch : s) {
        unsigned char c = (unsigned char)ch;
        if (c == '"' || c == '\\') { o += '\\'; o += ch; }
        else if (c < 0x20) { char b[8]; snprintf(b, sizeof b, "\\u%04x", c); o += b; }
        else o += ch;
    }
    return o + "\"";
}
static std::string jnum(double d)
{
    if (!std::isfinite(d)) return "null";
    char b[64];
    snprintf(b, sizeof b, "%.1f", d);
    return b;
}
static std::string jarr(const std::vector<double> &v)
{
    std::string o = "[";
    for (size_t i = 0; i < v.size(); i++) o += (i ? ", " : "") + jnum(v[i]);
    return o + "]";
}
static std::string jstats(const Stats &s)
{
    return "\"median\": " + jnum(s.median) + ", \"p25\": " + jnum(s.p25) + ", \"p75\": " +
           jnum(s.p75) + ", \"n\": " + std::to_string(s.n);
}

/* ------------------------------------------------------------------ main */
static void usage()
{
    fprintf(stderr,
            "usage: kind_cost [--rounds N] [--eager-n N] [--graph-k N] [--graph-r N] [--copy-m N] [--api-a N]\n"
            "                 [--pristine N] [--after N] [--setup both|activity|subscribe] [--configs a,b,c]\n"
            "                 [--budget-s S] [--out FILE.json]\n"
            "configs: none cb copies kernel all graph graph+kernel graph+kernel+cb cb-launch cb-launch-driver\n"
            "         cb-paused copies-ctx kernel-ctx\n");
}

static bool parse_int(const char *s, int *out, int lo)
{
    char *end = nullptr;
    long v = strtol(s, &end, 10);
    if (!end || *end || v < lo || v > 100000000) return false;
    *out = (int)v;
    return true;
}

int main(int argc, char **argv)
{
    const int64_t t_start = now_ns();
    Params p;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = (i + 1 < argc) ? argv[i + 1] : nullptr;
        bool ok = true;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); return 0; }
        if (!v) { ok = false; }
        else if (!strcmp(a, "--rounds")) ok = parse_int(v, &p.rounds, 1);
        else if (!strcmp(a, "--eager-n")) ok = parse_int(v, &p.eager_n, 1);
        else if (!strcmp(a, "--graph-k")) ok = parse_int(v, &p.graph_k, 1);
        else if (!strcmp(a, "--graph-r")) ok = parse_int(v, &p.graph_r, 1);
        else if (!strcmp(a, "--copy-m")) ok = parse_int(v, &p.copy_m, 1);
        else if (!strcmp(a, "--api-a")) ok = parse_int(v, &p.api_a, 1);
        else if (!strcmp(a, "--pristine")) ok = parse_int(v, &p.pristine, 0);
        else if (!strcmp(a, "--after")) ok = parse_int(v, &p.after, 0);
        else if (!strcmp(a, "--setup")) { p.setup = v; ok = p.setup == "both" || p.setup == "activity" || p.setup == "subscribe"; }
        else if (!strcmp(a, "--configs")) p.configs = v;
        else if (!strcmp(a, "--out")) p.out = v;
        else if (!strcmp(a, "--budget-s")) { p.budget_s = atof(v); ok = p.budget_s > 0; }
        else ok = false;
        if (!ok) {
            fprintf(stderr, "kind_cost: bad argument %s%s%s\n", a, v ? " " : "", v ? v : "");
            usage();
            return 1;
        }
        i++;
    }

    /* configurations: `none` always first in the list (every delta pairs against it) */
    std::vector<Config> known = all_configs(), cfgs;
    if (p.configs.empty()) {
        cfgs = known;
    } else {
        cfgs.push_back(known[0]);
        std::string spec = p.configs + ",";
        size_t pos = 0, comma;
        while ((comma = spec.find(',', pos)) != std::string::npos) {
            std::string name = spec.substr(pos, comma - pos);
            pos = comma + 1;
            if (name.empty() || name == "none") continue;
            bool found = false;
            for (const Config &c : known)
                if (name == c.name) {
                    bool dup = false;
                    for (const Config &d : cfgs) dup |= (name == d.name);
                    if (!dup) cfgs.push_back(c);
                    found = true;
                }
            if (!found) {
                fprintf(stderr, "kind_cost: unknown config %s\n", name.c_str());
                usage();
                return 1;
            }
        }
    }
    const int nc = (int)cfgs.size();
    if (nc > MAXCFG) { fprintf(stderr, "kind_cost: too many configs\n"); return 1; }

    /* a usable GPU, or one line and exit 2 */
    int ndev = 0;
    cudaError_t de = cudaGetDeviceCount(&ndev);
    if (de != cudaSuccess || ndev < 1) {
        fprintf(stderr, "kind_cost: no usable CUDA GPU (cudaGetDeviceCount: %s%s%s)\n",
                de != cudaSuccess ? cudaGetErrorName(de) : "0 devices",
                de != cudaSuccess ? ": " : "", de != cudaSuccess ? cudaGetErrorString(de) : "");
        return 2;
    }

    uint32_t cupti_version = 0;
    CKP(cuptiGetVersion(&cupti_version));
    int driver_version = 0, runtime_version = 0;
    CK(cudaDriverGetVersion(&driver_version));
    CK(cudaRuntimeGetVersion(&runtime_version));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    CK(cudaSetDevice(0));
    CK(cudaFree(nullptr));   /* the primary context, current from here on */
    {
        void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        typedef int (*get_current_t)(CUcontext *);
        get_current_t get_current = cuda ? (get_current_t)dlsym(cuda, "cuCtxGetCurrent") : nullptr;
        if (!get_current || get_current(&g_ctx) != 0) g_ctx = nullptr;
    }

    /* GPU objects; sanity: a kernel that writes one int */
    Gpu g;
    CK(cudaStreamCreateWithFlags(&g.s, cudaStreamNonBlocking));
    CK(cudaEventCreate(&g.e0));
    CK(cudaEventCreate(&g.e1));
    CK(cudaMalloc(&g.d_buf, 4096));
    CK(cudaMallocHost(&g.h_pinned, 4096));
    CK(cudaMemsetAsync(g.d_buf, 0, 4096, g.s));
    write_one<<<1, 32, 0, g.s>>>((int *)g.d_buf, 12345);
    CK(cudaPeekAtLastError());
    CK(cudaMemcpyAsync(g.h_pinned, g.d_buf, 4096, cudaMemcpyDeviceToHost, g.s));
    CK(cudaStreamSynchronize(g.s));
    if (*(int *)g.h_pinned != 12345) {
        fprintf(stderr, "kind_cost: sanity kernel wrote %d, expected 12345\n", *(int *)g.h_pinned);
        return 3;
    }
    capture_graph(p, g);

    /* --pristine: the workloads before CUPTI is set up (one warm-up round, discarded) */
    std::vector<std::vector<double>> pristine(M_COUNT);
    unpaired_rounds(p, g, p.pristine, pristine);

    /* CUPTI: buffers and the subscriber, once */
    if (p.setup != "subscribe") CKP(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
    if (p.setup == "activity") {
        g_sub_err = "--setup activity: no subscriber";
    } else {
        CUptiResult r = cuptiSubscribe(&g_sub, on_callback, nullptr);
        g_sub_ok = (r == CUPTI_SUCCESS);
        if (!g_sub_ok) {
            g_sub_err = cupti_str(r);
            note_error(std::string("cuptiSubscribe: ") + g_sub_err);
        }
    }
    collect_cbids();
    probe_cbids();
    int n_rt = 0, n_drv = 0;
    for (const Cbid &c : g_cbids) (c.domain == CUPTI_CB_DOMAIN_RUNTIME_API ? n_rt : n_drv)++;

    printf("kind_cost: %s, driver %d, runtime %d, CUPTI %u; %d configs x %d rounds (+1 warm-up); "
           "eager N=%d, graph K=%d R=%d, copy M=%d; %d runtime + %d driver cbids; "
           "estimate ~%.0f s (budget %.0f s)\n",
           prop.name, driver_version, runtime_version, cupti_version, nc, p.rounds, p.eager_n,
           p.graph_k, p.graph_r, p.copy_m, n_rt, n_drv,
           /* ~3 us a launch, ~1.5 us a node, ~4 us a copy, ~20 ms enable/instantiate/flush */
           nc * (p.rounds + 1) *
               (3e-6 * p.eager_n + 1.5e-6 * (p.graph_r + 2) * (p.graph_k + 2) + 4e-6 * p.copy_m + 0.02),
           p.budget_s);
    fflush(stdout);

    std::vector<std::string> cfg_err(nc);
    /* vals[c][m][round] */
    std::vector<std::vector<std::vector<double>>> vals(
        nc, std::vector<std::vector<double>>(M_COUNT, std::vector<double>(p.rounds, NAN)));
    std::vector<unsigned long long> cb_enter(nc, 0);
    std::vector<int> cfg_rounds(nc, 0);
    std::vector<std::vector<int>> orders;

    auto run_config = [&](int ci, int slot, double *m) -> bool {
        const Config &c = cfgs[ci];
        g_cur_slot.store(slot);
        std::string err = enable_config(c);
        if (!err.empty()) {
            cfg_err[ci] = err;
            note_error(std::string(c.name) + ": " + err + " (config skipped)");
            g_cur_slot.store(MAXCFG);
            return false;
        }
        unsigned long long cb0 = t_cb_enter;
        run_workloads(p, g, m);
        unsigned long long cb1 = t_cb_enter;
        disable_config(c);
        CUptiResult r = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
        if (r != CUPTI_SUCCESS) note_error(std::string("cuptiActivityFlushAll: ") + cupti_str(r));
        g_cur_slot.store(MAXCFG);
        if (slot != MAXCFG) cb_enter[ci] += cb1 - cb0;
        return true;
    };

    /* warm-up round: every configuration once, discarded; configurations CUPTI refuses drop out */
    int64_t tw0 = now_ns();
    for (int ci = 0; ci < nc; ci++) {
        double m[M_COUNT];
        run_config(ci, MAXCFG, m);
    }
    double warm_s = (double)(now_ns() - tw0) / 1e9;
    printf("kind_cost: warm-up round %.2f s\n", warm_s);
    fflush(stdout);

    /* measured rounds, rotated order; stop early if the budget would be overrun */
    double max_round_s = warm_s;
    int rounds_done = 0;
    for (int rd = 0; rd < p.rounds; rd++) {
        double elapsed = (double)(now_ns() - t_start) / 1e9;
        if (elapsed + max_round_s > p.budget_s) {
            note_error("budget: stopped after " + std::to_string(rd) + " of " +
                       std::to_string(p.rounds) + " rounds (--budget-s " + jnum(p.budget_s) + ")");
            break;
        }
        int64_t tr0 = now_ns();
        std::vector<int> order;
        for (int j = 0; j < nc; j++) {
            int ci = (rd + j) % nc;
            if (!cfg_err[ci].empty()) continue;
            order.push_back(ci);
            double m[M_COUNT];
            if (run_config(ci, ci, m)) {
                for (int k = 0; k < M_COUNT; k++) vals[ci][k][rd] = m[k];
                cfg_rounds[ci]++;
            }
        }
        orders.push_back(order);
        rounds_done++;
        double rs = (double)(now_ns() - tr0) / 1e9;
        if (rd == 0 || rs > max_round_s) max_round_s = rs;
    }

    if (g_sub_ok) cuptiUnsubscribe(g_sub);
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    /* --after: the workloads with the subscriber gone, then with CUPTI finalized (one thread: no
     * callback can be running) */
    std::vector<std::vector<double>> unsubscribed(M_COUNT), finalized(M_COUNT);
    if (p.after > 0) {
        unpaired_rounds(p, g, p.after, unsubscribed);
        CUptiResult r = cuptiFinalize();
        if (r == CUPTI_SUCCESS) unpaired_rounds(p, g, p.after, finalized);
        else note_error(std::string("cuptiFinalize: ") + cupti_str(r));
    }
    CK(cudaGraphDestroy(g.graph));
    const double wall_s = (double)(now_ns() - t_start) / 1e9;

    /* statistics */
    std::vector<std::vector<Stats>> st(nc, std::vector<Stats>(M_COUNT));
    std::vector<std::vector<Stats>> dst(nc, std::vector<Stats>(M_COUNT));
    std::vector<std::vector<std::vector<double>>> deltas(
        nc, std::vector<std::vector<double>>(M_COUNT, std::vector<double>(rounds_done, NAN)));
    for (int ci = 0; ci < nc; ci++)
        for (int k = 0; k < M_COUNT; k++) {
            vals[ci][k].resize(rounds_done);
            for (int rd = 0; rd < rounds_done; rd++)
                deltas[ci][k][rd] = vals[ci][k][rd] - vals[0][k][rd];
            st[ci][k] = stats_of(vals[ci][k]);
            dst[ci][k] = stats_of(deltas[ci][k]);
        }

    /* JSON */
    std::string j = "{\n";
    j += "  \"bench\": \"kind_cost\",\n";
    j += "  \"device\": " + jstr(prop.name) + ",\n";
    j += "  \"compute_capability\": \"" + std::to_string(prop.major) + "." +
         std::to_string(prop.minor) + "\",\n";
    j += "  \"driver_version\": " + std::to_string(driver_version) + ",\n";
    j += "  \"runtime_version\": " + std::to_string(runtime_version) + ",\n";
    j += "  \"cupti_version\": " + std::to_string(cupti_version) + ",\n";
    j += "  \"cupti_api_version_header\": " + std::to_string((long)CUPTI_API_VERSION) + ",\n";
    j += "  \"params\": {\"rounds\": " + std::to_string(p.rounds) +
         ", \"rounds_done\": " + std::to_string(rounds_done) +
         ", \"eager_n\": " + std::to_string(p.eager_n) +
         ", \"graph_k\": " + std::to_string(p.graph_k) +
         ", \"graph_r\": " + std::to_string(p.graph_r) +
         ", \"graph_nodes\": " + std::to_string(p.graph_k + 2) +
         ", \"copy_m\": " + std::to_string(p.copy_m) +
         ", \"copy_bytes\": 4096, \"activity_buffer_bytes\": " + std::to_string(BUF_BYTES) +
         ", \"budget_s\": " + jnum(p.budget_s) + "},\n";
    j += "  \"wall_s\": " + jnum(wall_s) + ", \"warmup_round_s\": " + jnum(warm_s) +
         ", \"max_round_s\": " + jnum(max_round_s) + ",\n";
    j += "  \"callback_cbids\": {\"runtime\": " + std::to_string(n_rt) +
         ", \"driver\": " + std::to_string(n_drv) +
         ", \"refused\": " + std::to_string(g_cbids_refused) + ", \"names\": [";
    for (size_t i = 0; i < g_cbids.size(); i++) j += (i ? ", " : "") + jstr(g_cbids[i].name);
    j += "]},\n";
    j += "  \"configs\": [\n";
    for (int ci = 0; ci < nc; ci++) {
        const Config &c = cfgs[ci];
        j += "    {\"name\": " + jstr(c.name) + ", \"kinds\": [";
        for (size_t i = 0; i < c.kinds.size(); i++) {
            const char *kn = kind_name((int)c.kinds[i]);
            j += (i ? ", " : "") + jstr(kn ? kn : "?");
        }
        static const char *const CB_SETS[] = {"null", "\"all\"", "\"launch\"", "\"launch-driver\"",
                                              "\"paused\""};
        j += std::string("], \"callbacks\": ") + CB_SETS[c.cb];
        j += std::string(", \"per_context\": ") + (c.per_ctx ? "true" : "false");
        j += ", \"rounds\": " + std::to_string(cfg_rounds[ci]);
        j += ", \"error\": " + (cfg_err[ci].empty() ? std::string("null") : jstr(cfg_err[ci]));
        j += ", \"records\": {";
        bool first = true;
        for (int k = 0; k <= KMAX; k++) {
            unsigned long long n = g_rec[ci][k].load();
            if (!n) continue;
            const char *kn = k < KMAX ? kind_name(k) : "other";
            std::string name = kn ? kn : "kind_" + std::to_string(k);
            j += (first ? "" : ", ") + jstr(name) + ": " + std::to_string(n);
            first = false;
        }
        j += "}, \"records_per_round\": {";
        first = true;
        for (int k = 0; k <= KMAX; k++) {
            unsigned long long n = g_rec[ci][k].load();
            if (!n || !cfg_rounds[ci]) continue;
            const char *kn = k < KMAX ? kind_name(k) : "other";
            std::string name = kn ? kn : "kind_" + std::to_string(k);
            j += (first ? "" : ", ") + jstr(name) + ": " + jnum((double)n / cfg_rounds[ci]);
            first = false;
        }
        j += "}, \"dropped_records\": " + std::to_string(g_dropped[ci].load());
        j += ", \"callbacks_per_round\": " +
             (cfg_rounds[ci] ? jnum((double)cb_enter[ci] / cfg_rounds[ci]) : std::string("null"));
        j += std::string("}") + (ci + 1 < nc ? "," : "") + "\n";
    }
    j += "  ],\n";
    j += "  \"warmup_records\": {";
    {
        bool first = true;
        for (int k = 0; k <= KMAX; k++) {
            unsigned long long n = g_rec[MAXCFG][k].load();
            if (!n) continue;
            const char *kn = k < KMAX ? kind_name(k) : "other";
            std::string name = kn ? kn : "kind_" + std::to_string(k);
            j += (first ? "" : ", ") + jstr(name) + ": " + std::to_string(n);
            first = false;
        }
    }
    j += "},\n";
    j += "  \"buffers_completed\": " + std::to_string(g_buffers.load()) +
         ", \"buffer_allocation_failures\": " + std::to_string(g_buffer_nulls.load()) + ",\n";
    j += "  \"round_orders\": [";
    for (size_t r = 0; r < orders.size(); r++) {
        j += (r ? ", [" : "[");
        for (size_t i = 0; i < orders[r].size(); i++)
            j += (i ? ", " : "") + jstr(cfgs[orders[r][i]].name);
        j += "]";
    }
    j += "],\n";
    j += "  \"results\": [\n";
    bool first_row = true;
    for (int ci = 0; ci < nc; ci++)
        for (int k = 0; k < M_COUNT; k++) {
            if (!first_row) j += ",\n";
            first_row = false;
            j += "    {\"config\": " + jstr(cfgs[ci].name) + ", \"workload\": " +
                 jstr(METRICS[k].workload) + ", \"metric\": " + jstr(METRICS[k].metric) +
                 ", \"unit\": " + jstr(METRICS[k].unit) + ", " + jstats(st[ci][k]) +
                 ", \"values\": " + jarr(vals[ci][k]) +
                 ",\n     \"delta_vs_none\": {" + jstats(dst[ci][k]) +
                 ", \"values\": " + jarr(deltas[ci][k]) + "}}";
        }
    j += "\n  ],\n";
    /* before CUPTI was set up, after its subscriber left, after cuptiFinalize: medians, not paired
     * (nothing to alternate with) */
    auto unpaired = [&](const char *name, const std::vector<std::vector<double>> &v) {
        j += std::string("  \"") + name + "\": {\"rounds\": " + std::to_string(v[0].size()) + ", \"results\": [";
        for (int k = 0; k < M_COUNT && !v[0].empty(); k++) {
            Stats ps = stats_of(v[k]);
            j += std::string(k ? ",\n" : "\n") + "    {\"workload\": " + jstr(METRICS[k].workload) +
                 ", \"metric\": " + jstr(METRICS[k].metric) + ", \"unit\": " + jstr(METRICS[k].unit) + ", " +
                 jstats(ps) + ", \"values\": " + jarr(v[k]) + ", \"none_median_minus_this\": " +
                 jnum(st[0][k].median - ps.median) + "}";
        }
        j += "]},\n";
    };
    j += "  \"setup\": " + jstr(p.setup) + ",\n";
    unpaired("pristine", pristine);
    unpaired("unsubscribed", unsubscribed);
    unpaired("finalized", finalized);
    j += "  \"errors\": [";
    for (size_t i = 0; i < g_errors.size(); i++) j += (i ? ", " : "") + jstr(g_errors[i]);
    j += "]\n}\n";

    /* table: median ns/unit and median paired delta vs none */
    printf("\nmedian ns per unit (launch / node / copy) [median paired delta vs none], %d rounds\n",
           rounds_done);
    printf("%-16s", "config");
    for (int k = 0; k < M_COUNT; k++) {
        char h[48];
        snprintf(h, sizeof h, "%s.%s", METRICS[k].workload,
                 k == M_GRAPH_INST ? "inst" : METRICS[k].metric);
        printf(" %17s", h);
    }
    printf("\n");
    for (int ci = 0; ci < nc; ci++) {
        printf("%-16s", cfgs[ci].name);
        if (!cfg_err[ci].empty()) {
            printf(" skipped: %s\n", cfg_err[ci].c_str());
            continue;
        }
        for (int k = 0; k < M_COUNT; k++) {
            char cell[48];
            if (ci == 0)
                snprintf(cell, sizeof cell, "%.0f", st[ci][k].median);
            else
                snprintf(cell, sizeof cell, "%.0f [%+.0f]", st[ci][k].median, dst[ci][k].median);
            printf(" %17s", cell);
        }
        printf("\n");
    }
    const std::vector<std::vector<double>> *rows[] = {&pristine, &unsubscribed, &finalized};
    const char *row_names[] = {"pristine", "unsubscribed", "finalized"};
    for (int i = 0; i < 3; i++) {
        if ((*rows[i])[0].empty()) continue;
        printf("%-16s", row_names[i]);   /* unpaired: medians, [none - this] */
        for (int k = 0; k < M_COUNT; k++) {
            Stats ps = stats_of((*rows[i])[k]);
            char cell[48];
            snprintf(cell, sizeof cell, "%.0f [%+.0f]", ps.median, st[0][k].median - ps.median);
            printf(" %17s", cell);
        }
        printf("\n");
    }
    printf("records per round:");
    for (int ci = 0; ci < nc; ci++) {
        if (!cfg_rounds[ci]) continue;
        std::string s;
        for (int k = 0; k <= KMAX; k++) {
            unsigned long long n = g_rec[ci][k].load();
            if (!n) continue;
            const char *kn = k < KMAX ? kind_name(k) : "other";
            char b[96];
            snprintf(b, sizeof b, "%s%s=%.0f", s.empty() ? "" : ",",
                     kn ? kn : ("kind_" + std::to_string(k)).c_str(), (double)n / cfg_rounds[ci]);
            s += b;
        }
        printf(" %s{%s}", cfgs[ci].name, s.c_str());
    }
    printf("\nwall %.1f s, %zu error(s)\n", wall_s, g_errors.size());

    FILE *f = fopen(p.out.c_str(), "w");
    if (!f || fwrite(j.data(), 1, j.size(), f) != j.size() || fclose(f) != 0) {
        fprintf(stderr, "kind_cost: cannot write %s\n", p.out.c_str());
        return 3;
    }
    printf("kind_cost: wrote %s\n", p.out.c_str());
    return 0;
}
