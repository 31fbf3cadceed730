// workload.cu - GPU work whose census is known in advance, to check the census exactly.
// Prints the expected totals as one JSON line; tests/gpu/test_gpu_census.py compares them with
// the segment this process leaves behind.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>
#include "census_wait.h"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)

__global__ void empty_kernel() {}

// Spins for about `ns` of GPU time (globaltimer), so overlap on two streams is measurable.
__global__ void spin_kernel(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}

int main(int argc, char **argv) {
    const size_t MiB = 1 << 20;
    const int eager = argc > 1 ? atoi(argv[1]) : 1000;
    const int graph_nodes = 100, graph_replays = 10, update_replays = 5;
    CK(cudaSetDevice(0));
    CK(cudaFree(0));                      // the context exists now ...
    census_wait();                        // ... and the census counts from here
    char *d0, *d1, *pinned, *pageable;
    CK(cudaMalloc(&d0, 64 * MiB));
    CK(cudaMalloc(&d1, 64 * MiB));
    CK(cudaMallocHost(&pinned, 64 * MiB));
    pageable = (char *)malloc(64 * MiB);
    memset(pageable, 1, 64 * MiB);

    CK(cudaMemcpy(d0, pageable, 64 * MiB, cudaMemcpyHostToDevice));   // HtoD pageable 64 MiB
    CK(cudaMemcpy(d1, pinned, 64 * MiB, cudaMemcpyHostToDevice));     // HtoD pinned 64 MiB
    CK(cudaMemcpy(pageable, d0, 64 * MiB, cudaMemcpyDeviceToHost));   // DtoH pageable 64 MiB
    CK(cudaMemcpy(pinned, d1, 32 * MiB, cudaMemcpyDeviceToHost));     // DtoH pinned 32 MiB
    CK(cudaMemcpy(d1, d0, 16 * MiB, cudaMemcpyDeviceToDevice));       // DtoD 16 MiB
    CK(cudaMemset(d0, 0, 8 * MiB));                                   // memset 8 MiB

    for (int i = 0; i < eager; i++) empty_kernel<<<1, 1>>>();
    CK(cudaDeviceSynchronize());

    // A graph: graph_nodes kernels then one 1 MiB DtoH into pinned memory, replayed.
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < graph_nodes; i++) empty_kernel<<<1, 1, 0, s>>>();
    CK(cudaMemcpyAsync(pinned, d0, 1 * MiB, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < graph_replays; i++) CK(cudaGraphLaunch(ge, s));
    CK(cudaStreamSynchronize(s));

    // The same exec updated from a graph of the same shape whose copy is 2 MiB (as llama.cpp updates
    // its graph every token), replayed: the census must count the new contents. Where the driver
    // refuses the update, the exec is made anew (the census then learns a new exec).
    cudaGraph_t g2;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < graph_nodes; i++) empty_kernel<<<1, 1, 0, s>>>();
    CK(cudaMemcpyAsync(pinned, d0, 2 * MiB, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamEndCapture(s, &g2));
    cudaGraphExecUpdateResultInfo info;
    int updated = cudaGraphExecUpdate(ge, g2, &info) == cudaSuccess;
    if (!updated) {
        (void)cudaGetLastError();
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphInstantiate(&ge, g2, 0));
    }
    for (int i = 0; i < update_replays; i++) CK(cudaGraphLaunch(ge, s));
    CK(cudaStreamSynchronize(s));

    // Two 20 ms spins on two streams at once: summed kernel time ~40 ms, busy ~20 ms.
    cudaStream_t a, b;
    CK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    spin_kernel<<<1, 1, 0, a>>>(20000000ull);
    spin_kernel<<<1, 1, 0, b>>>(20000000ull);
    CK(cudaDeviceSynchronize());

    printf("{\"kernels\": %d, \"htod_pageable\": %zu, \"htod_pinned\": %zu, \"dtoh_pageable\": %zu, "
           "\"dtoh_pinned\": %zu, \"dtod\": %zu, \"memset\": %zu, \"copies_htod\": 2, \"copies_dtoh\": %d, "
           "\"copies_dtod\": 1, \"memsets\": 1, \"spin_ns\": 20000000, \"graph_kernels\": %d, "
           "\"graph_launches\": %d, \"exec_updated\": %d}\n",
           eager + graph_nodes * (graph_replays + update_replays) + 2, 64 * MiB, 64 * MiB, 64 * MiB,
           32 * MiB + (size_t)graph_replays * MiB + (size_t)update_replays * 2 * MiB, 16 * MiB, 8 * MiB,
           2 + graph_replays + update_replays, graph_nodes * (graph_replays + update_replays),
           graph_replays + update_replays, updated);
    return 0;
}
