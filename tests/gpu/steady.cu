// steady.cu - a steady stream of GPU work for a given time, to check sampled kernel tracing:
// every millisecond `per_ms` tiny kernels (eager), every 10 ms a graph of 20 kernel nodes and one
// 1 MiB device-to-host copy into pinned memory, plus a 64 KiB host-to-device copy from pageable
// memory. Prints what it did as one JSON line.
//   steady SECONDS PER_MS [SPIN_NS]
// SPIN_NS: every kernel, eager or a graph's node, spins that long on the GPU's global timer (0: empty), so that
// samples of kernel durations have a known answer.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <cuda_runtime.h>
#include "census_wait.h"
#include "spin.cuh"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)

static double now_s() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const double seconds = argc > 1 ? atof(argv[1]) : 2.0;
    const int per_ms = argc > 2 ? atoi(argv[2]) : 20;
    const unsigned long long spin = argc > 3 ? strtoull(argv[3], NULL, 10) : 0;
    const size_t MiB = 1 << 20, small = 64 << 10;
    char *d, *pinned, *pageable;
    CK(cudaSetDevice(0));
    CK(cudaFree(0));                      // the context exists now ...
    census_wait();                        // ... and the census counts from here
    CK(cudaMalloc(&d, 2 * MiB));
    CK(cudaMallocHost(&pinned, MiB));
    pageable = (char *)malloc(small);
    memset(pageable, 3, small);
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < 20; i++) spin_kernel<<<1, 1, 0, s>>>(spin);
    CK(cudaMemcpyAsync(pinned, d, MiB, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    long kernels = 0, graphs = 0, htod = 0;
    const double t0 = now_s();
    for (long ms = 0; now_s() - t0 < seconds; ms++) {
        for (int i = 0; i < per_ms; i++) spin_kernel<<<1, 1, 0, s>>>(spin);
        kernels += per_ms;
        if (ms % 10 == 0) {
            CK(cudaGraphLaunch(ge, s));
            graphs++;
            kernels += 20;
            CK(cudaMemcpyAsync(d + MiB, pageable, small, cudaMemcpyHostToDevice, s));
            htod++;
        }
        CK(cudaStreamSynchronize(s));
        double next = t0 + (ms + 1) * 1e-3;
        while (now_s() < next) {}
    }
    printf("{\"kernels\": %ld, \"graph_launches\": %ld, \"dtoh_pinned_count\": %ld, \"dtoh_pinned_bytes\": %zu, "
           "\"htod_pageable_count\": %ld, \"htod_pageable_bytes\": %zu, \"seconds\": %.3f}\n",
           kernels, graphs, graphs, (size_t)graphs * MiB, htod, (size_t)htod * small, now_s() - t0);
    return 0;
}
