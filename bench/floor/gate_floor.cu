// gate_floor.cu - what a gated CUDA event pair reads around kernels of known length, and what it reads around
// nothing, no census involved (OTEL_GPU_CENSUS_ACTIVITY=events' gate, native/src/events.c). A gate: the stream
// waits for a word of mapped pinned host memory (cuStreamWaitValue32), the host writes it once the pair and its
// work are submitted, so the GPU meets them back to back. Medians of N repetitions, each from an idle stream:
//   gated_kernel_<spin>   wait, A, kernel spinning <spin> ns (1 block), B: B - A
//   gated_wide_0          the same, an empty kernel of 528 blocks of 128 threads
//   gated_empty           wait, A, B (nothing between): B - A
//   gated_lead_<spin>     wait, C, A, kernel, B: A - C (one event after another) beside B - A
//   queued_<spin>         a 50 us kernel, then A, kernel, B, no gate: B - A (the first event fires as work ends)
// and the host's time per call: cuStreamWaitValue32, cuEventRecord, the first wait of the process.
//   gate_floor [N] > floor.json
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <vector>
#include <algorithm>
#include <cuda.h>
#include <cuda_runtime.h>
#include "clock.h"
#include "../../tests/gpu/spin.cuh"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)
#define CD(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { fprintf(stderr, "%s:%d CUresult %d\n", __FILE__, __LINE__, (int)r); exit(1); } } while (0)

static volatile unsigned *word;
static CUdeviceptr dword;
static unsigned seq;
static cudaStream_t s;
static cudaEvent_t ea, eb, ec;
static std::vector<double> wait_ns, record_ns;

static void gate() {
    double t = now_ns();
    CD(cuStreamWaitValue32((CUstream)s, dword, ++seq, CU_STREAM_WAIT_VALUE_GEQ));
    wait_ns.push_back(now_ns() - t);
}
static void open_gate() { __atomic_store_n(word, seq, __ATOMIC_RELEASE); }
static void rec(cudaEvent_t ev) {
    double t = now_ns();
    CK(cudaEventRecord(ev, s));
    record_ns.push_back(now_ns() - t);
}
static float between(cudaEvent_t a, cudaEvent_t b) {
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms * 1e6f;
}

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 2000;
    CK(cudaSetDevice(0));
    CK(cudaFree(0));
    unsigned *h;
    CK(cudaHostAlloc((void **)&h, 4096, cudaHostAllocMapped));
    *h = 0;
    word = h;
    CD(cuMemHostGetDevicePointer(&dword, h, 0));
    CK(cudaStreamCreate(&s));
    CK(cudaEventCreate(&ea));
    CK(cudaEventCreate(&eb));
    CK(cudaEventCreate(&ec));
    spin_kernel<<<1, 1, 0, s>>>(0);   // loaded before any gate
    spin_kernel<<<528, 128, 0, s>>>(0);
    CK(cudaStreamSynchronize(s));
    double t = now_ns();
    CD(cuStreamWaitValue32((CUstream)s, dword, ++seq, CU_STREAM_WAIT_VALUE_GEQ));
    double first_wait = now_ns() - t;
    open_gate();
    CK(cudaStreamSynchronize(s));

    const unsigned long long spins[] = {0, 1000, 3000, 10000, 20000};
    printf("{\"n\": %d, \"first_wait_ns\": %.0f", n, first_wait);
    for (unsigned long long spin : spins) {
        std::vector<double> g, lead_a, lead_b, q;
        for (int i = 0; i < n; i++) {
            gate(); rec(ea); spin_kernel<<<1, 1, 0, s>>>(spin); rec(eb); open_gate();
            CK(cudaStreamSynchronize(s));
            g.push_back(between(ea, eb));
            gate(); rec(ec); rec(ea); spin_kernel<<<1, 1, 0, s>>>(spin); rec(eb); open_gate();
            CK(cudaStreamSynchronize(s));
            lead_a.push_back(between(ec, ea));
            lead_b.push_back(between(ea, eb));
            spin_kernel<<<1, 1, 0, s>>>(50000); rec(ea); spin_kernel<<<1, 1, 0, s>>>(spin); rec(eb);
            CK(cudaStreamSynchronize(s));
            q.push_back(between(ea, eb));
        }
        printf(", \"gated_kernel_%llu\": %.0f, \"gated_lead_%llu\": [%.0f, %.0f], \"queued_%llu\": %.0f", spin, median(g),
               spin, median(lead_a), median(lead_b), spin, median(q));
    }
    std::vector<double> w, e;
    for (int i = 0; i < n; i++) {
        gate(); rec(ea); spin_kernel<<<528, 128, 0, s>>>(0); rec(eb); open_gate();
        CK(cudaStreamSynchronize(s));
        w.push_back(between(ea, eb));
        gate(); rec(ea); rec(eb); open_gate();
        CK(cudaStreamSynchronize(s));
        e.push_back(between(ea, eb));
    }
    printf(", \"gated_wide_0\": %.0f, \"gated_empty\": %.0f, \"wait_call_ns\": %.0f, \"record_call_ns\": %.0f}\n",
           median(w), median(e), median(wait_ns), median(record_ns));
    return 0;
}
