/*
 * toggle_cupti.cu - does CUPTI keep delivering eager kernel records when CONCURRENT_KERNEL is switched
 * off and on while a process launches kernels? No census here: CUPTI alone, to tell a CUPTI behaviour
 * from a census bug (docs/measurements.md §17-§18: under the census's duty cycle and pauses, eager
 * kernel records stopped for good while copies and graph records went on, with no drop reported).
 *
 * One worker thread launches work like a decode loop: every millisecond `--per-ms` short kernels and,
 * every 10 ms, a graph of 20 kernels and a 4 KiB D2H copy, then one stream synchronize. The main thread
 * runs `--cycles` on/off cycles of `--on-ms`/`--off-ms`; every --flush-ms it calls
 * cuptiActivityFlushAll(0), as the census's flusher does. Each cycle switches with `--switch`:
 *   kernel   cuptiActivityDisable/Enable(CONCURRENT_KERNEL) only (the census's duty cycle)
 *   all      every enabled kind off and on again, in the order they were enabled (a pause)
 *   context  cuptiActivityDisableContext/EnableContext(ctx, CONCURRENT_KERNEL)
 *   kg       GRAPH_TRACE off, CONCURRENT_KERNEL switched, GRAPH_TRACE on again
 *   global-then-context  `kernel` for the first half of the cycles, `context` after: does switching per
 *            context bring back the records that global switching lost?
 * `--create-off 1` (with --setup before): the kind is disabled globally when the context is made (a
 * census set up in cuInit is in its duty cycle's off part 90 % of the time); the first cycle enables it.
 * `--pre-toggles N` (with --setup before): N global off/on switches of CONCURRENT_KERNEL before the
 * context exists (a census set up in cuInit runs its duty cycle before the server makes a context).
 * `--setup before` enables CUPTI before the CUDA context exists (as the census's ATTACH=cuinit does),
 * `after` once it does (the census's default). `--graph 0` leaves GRAPH_TRACE off (graph nodes then
 * come as kernel records of their own; the counts below are of eager kernels only: graphId == 0).
 * `--subscribe 1` also subscribes a callback on the runtime's launch calls (the census's counting).
 * `--repair N`: after N on-phases in a row with launches and no eager record, the next on-switch first
 * calls cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED) and switches the kind off and on once
 * more; the output says whether records came back.
 *
 * Output: one JSON line: per on-phase the eager launches made in it and the eager kernel records
 * whose start falls in it (CUPTI timestamps of the phase bounds), plus summary counts.
 * Build: make -C bench/floor toggle_cupti [BUILD=...] [CUPTI_INCLUDE_DIR=...] [CUPTI_LIB_DIR=...]
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <cupti_activity.h>
#include <cupti_callbacks.h>
#include <cupti_result.h>
#include <cupti_runtime_cbid.h>

#include <atomic>
#include <cstdint>
#include <dlfcn.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "toggle_cupti: %s at line %d\n", cudaGetErrorString(e_), __LINE__); exit(3); } } while (0)
#define CKP(x) do { CUptiResult r_ = (x); if (r_ != CUPTI_SUCCESS) { const char *s_ = "?"; \
    cuptiGetResultString(r_, &s_); fprintf(stderr, "toggle_cupti: %s at line %d: %s\n", s_, __LINE__, #x); \
    exit(3); } } while (0)

__global__ void spin(int ns) {
    uint64_t t0 = clock64();
    while ((int64_t)(clock64() - t0) < ns) {}
}

static const int MAX_PHASES = 4096;
static uint64_t g_bound[MAX_PHASES + 1];            // CUPTI timestamp at each phase start
static std::atomic<int> g_nphase{0};
static std::atomic<uint64_t> g_records_in[MAX_PHASES];  // eager kernel records starting in phase i
static std::atomic<uint64_t> g_eager_records{0}, g_graph_records{0}, g_copy_records{0}, g_other{0};
static std::atomic<uint64_t> g_launched{0};          // eager launches made so far
static std::atomic<bool> g_stop{false};

static void CUPTIAPI requested(uint8_t **buf, size_t *size, size_t *max) {
    *size = 4u << 20;
    *buf = (uint8_t *)aligned_alloc(8, *size);
    *max = 0;
}

static int phase_of(uint64_t t) {  // last phase whose start <= t
    int n = g_nphase.load(), lo = 0, hi = n - 1;
    if (n == 0 || t < g_bound[0]) return -1;
    while (lo < hi) { int mid = (lo + hi + 1) / 2; if (g_bound[mid] <= t) lo = mid; else hi = mid - 1; }
    return lo;
}

static void CUPTIAPI completed(CUcontext, uint32_t, uint8_t *buf, size_t, size_t valid) {
    CUpti_Activity *r = nullptr;
    while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            auto *k = (CUpti_ActivityKernel13 *)r;  // the census reads the same layout (internal.h)
            if (k->graphId) continue;
            g_eager_records++;
            int p = phase_of(k->start);
            if (p >= 0) g_records_in[p]++;
        } else if (r->kind == CUPTI_ACTIVITY_KIND_GRAPH_TRACE) g_graph_records++;
        else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) g_copy_records++;
        else g_other++;
    }
    free(buf);
}

static std::atomic<uint64_t> g_callbacks{0};
static void CUPTIAPI on_cb(void *, CUpti_CallbackDomain, CUpti_CallbackId, const void *) { g_callbacks++; }

static uint64_t mono_ms() {
    timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static void worker(int per_ms, int kernel_ns) {
    CK(cudaSetDevice(0));
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    char *d, *h; CK(cudaMalloc(&d, 4096)); CK(cudaMallocHost(&h, 4096));
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < 20; i++) spin<<<1, 32, 0, s>>>(kernel_ns);
    CK(cudaMemcpyAsync(h, d, 4096, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (uint64_t ms = 0; !g_stop.load(); ms++) {
        for (int i = 0; i < per_ms; i++) spin<<<1, 32, 0, s>>>(kernel_ns);
        g_launched += per_ms;
        if (ms % 10 == 0) CK(cudaGraphLaunch(ge, s));
        CK(cudaStreamSynchronize(s));
    }
}

int main(int argc, char **argv) {
    const char *sw = "kernel", *setup = "after";
    int per_ms = 50, kernel_ns = 2000, cycles = 40, on_ms = 100, off_ms = 200, flush_ms = 1000, graph = 1,
        subscribe = 0, repair = 0, pre_toggles = 0, create_off = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--switch")) sw = v; else if (!strcmp(k, "--setup")) setup = v;
        else if (!strcmp(k, "--per-ms")) per_ms = atoi(v); else if (!strcmp(k, "--kernel-ns")) kernel_ns = atoi(v);
        else if (!strcmp(k, "--cycles")) cycles = atoi(v); else if (!strcmp(k, "--on-ms")) on_ms = atoi(v);
        else if (!strcmp(k, "--off-ms")) off_ms = atoi(v); else if (!strcmp(k, "--flush-ms")) flush_ms = atoi(v);
        else if (!strcmp(k, "--graph")) graph = atoi(v); else if (!strcmp(k, "--subscribe")) subscribe = atoi(v);
        else if (!strcmp(k, "--repair")) repair = atoi(v);
        else if (!strcmp(k, "--pre-toggles")) pre_toggles = atoi(v);
        else if (!strcmp(k, "--create-off")) create_off = atoi(v);
        else { fprintf(stderr, "toggle_cupti: unknown flag %s\n", k); return 1; }
    }
    if (cycles * 2 + 2 > MAX_PHASES) { fprintf(stderr, "toggle_cupti: too many cycles\n"); return 1; }
    std::vector<CUpti_ActivityKind> kinds = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                             CUPTI_ACTIVITY_KIND_MEMCPY2, CUPTI_ACTIVITY_KIND_MEMSET};
    if (graph) kinds.push_back(CUPTI_ACTIVITY_KIND_GRAPH_TRACE);
    auto enable = [&]() {
        CKP(cuptiActivityRegisterCallbacks(requested, completed));
        CUpti_SubscriberHandle sub;
        if (subscribe) {
            CKP(cuptiSubscribe(&sub, on_cb, nullptr));
            CKP(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000));
        }
        for (auto k : kinds) CKP(cuptiActivityEnable(k));
    };
    if (!strcmp(setup, "before")) {
        enable();
        for (int i = 0; i < pre_toggles; i++) {
            CKP(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
            CKP(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
        }
        if (create_off) CKP(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    }
    CK(cudaSetDevice(0));
    CK(cudaFree(0));
    CUcontext ctx = nullptr;   // the driver's, from the libcuda the runtime loaded (no -lcuda to link)
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    auto get_current = cuda ? (CUresult (*)(CUcontext *))dlsym(cuda, "cuCtxGetCurrent") : nullptr;
    if (!get_current || get_current(&ctx) != CUDA_SUCCESS || !ctx) { fprintf(stderr, "toggle_cupti: no context\n"); return 2; }
    if (strcmp(setup, "before") != 0) enable();
    std::thread w(worker, per_ms, kernel_ns);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));   // graph built, steady launches
    int cycle = 0;   // global-then-context: the first half of the cycles switch globally, the rest per context
    auto set_kernel = [&](bool on) {
        bool ctx_now = !strcmp(sw, "context") || (!strcmp(sw, "global-then-context") && cycle >= cycles / 2);
        if (ctx_now) CKP(on ? cuptiActivityEnableContext(ctx, CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
                                           : cuptiActivityDisableContext(ctx, CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
        else if (!strcmp(sw, "all")) for (auto k : kinds) CKP(on ? cuptiActivityEnable(k) : cuptiActivityDisable(k));
        else if (!strcmp(sw, "kg") && graph) {   // GRAPH_TRACE off around the kernel kind's switch
            CKP(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_GRAPH_TRACE));
            CKP(on ? cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
                   : cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
            CKP(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_GRAPH_TRACE));
        }
        else CKP(on ? cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
                    : cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    };
    if (create_off) set_kernel(true);
    std::vector<uint64_t> launched_at(2 * cycles + 2);
    uint64_t next_flush = mono_ms() + flush_ms;
    int dead_run = 0, repairs = 0;
    auto wait_ms = [&](int ms) {
        uint64_t end = mono_ms() + ms;
        while (mono_ms() < end) {
            if (mono_ms() >= next_flush) { cuptiActivityFlushAll(0); next_flush += flush_ms; }
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
    };
    // phase 2c: on (kind enabled from the start), phase 2c+1: off
    for (int c = 0; c < cycles; c++) {
        cycle = c;
        uint64_t ts; cuptiGetTimestamp(&ts);
        g_bound[2 * c] = ts; launched_at[2 * c] = g_launched.load(); g_nphase = 2 * c + 1;
        wait_ms(on_ms);
        set_kernel(false);
        cuptiGetTimestamp(&ts);
        g_bound[2 * c + 1] = ts; launched_at[2 * c + 1] = g_launched.load(); g_nphase = 2 * c + 2;
        wait_ms(off_ms);
        // did the last on-phase get its records? (off_ms >= flush_ms makes this exact; else a floor)
        cuptiActivityFlushAll(0);
        bool dead = g_records_in[2 * c].load() == 0;
        dead_run = dead ? dead_run + 1 : 0;
        if (repair && dead_run >= repair) {
            cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
            set_kernel(true); set_kernel(false);
            repairs++;
            dead_run = 0;
        }
        set_kernel(true);
    }
    uint64_t ts; cuptiGetTimestamp(&ts);
    g_bound[2 * cycles] = ts; launched_at[2 * cycles] = g_launched.load(); g_nphase = 2 * cycles + 1;
    g_stop = true;
    w.join();
    CK(cudaDeviceSynchronize());
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    int on_dead = 0, first_dead = -1, off_with = 0;
    printf("{\"switch\":\"%s\",\"setup\":\"%s\",\"graph\":%d,\"subscribe\":%d,\"repair\":%d,\"per_ms\":%d,"
           "\"create_off\":%d,\"pre_toggles\":%d,\"on_ms\":%d,\"off_ms\":%d,\"cycles\":%d,\"on\":[", sw, setup, graph, subscribe, repair,
           per_ms, create_off, pre_toggles, on_ms, off_ms, cycles);
    for (int c = 0; c < cycles; c++) {
        uint64_t l = launched_at[2 * c + 1] - launched_at[2 * c], r = g_records_in[2 * c].load();
        if (l && !r) { on_dead++; if (first_dead < 0) first_dead = c; }
        if (g_records_in[2 * c + 1].load() > (uint64_t)per_ms * 20) off_with++;
        printf("%s[%llu,%llu]", c ? "," : "", (unsigned long long)l, (unsigned long long)r);
    }
    printf("],\"on_phases_without_records\":%d,\"first_without\":%d,\"off_phases_with_records\":%d,"
           "\"repairs\":%d,\"eager_records\":%llu,\"graph_records\":%llu,\"copy_records\":%llu,\"callbacks\":%llu}\n",
           on_dead, first_dead, off_with, repairs, (unsigned long long)g_eager_records.load(),
           (unsigned long long)g_graph_records.load(), (unsigned long long)g_copy_records.load(),
           (unsigned long long)g_callbacks.load());
    return 0;
}
