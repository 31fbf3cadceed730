// cuda_prog.cu - tiny CUDA processes for the reliability suite (fast to start, no Python).
//
//   cuda_prog init                 create a context, launch nothing (GPU discovery-like)
//   cuda_prog short                1 kernel, 1 memset, 1 device-to-host copy of 128 bytes, exit
//   cuda_prog nosync               a 300 ms kernel and an async copy in flight, return from main
//   cuda_prog nosync_exit          the same, then _exit(0): no atexit handlers, no teardown
//   cuda_prog loop SECONDS         kernels and 128-byte copies until SECONDS pass; prints counts
//
// Prints one JSON line with what it launched, so the suite can compare with the census.
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "cuda_prog: %s: %s\n", #x, cudaGetErrorString(e_)); return 3; } } while (0)

__device__ unsigned long long gtime() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void spin(unsigned long long ns) {
    unsigned long long t0 = gtime();
    while (gtime() - t0 < ns) { }
}

__global__ void add1(float *x) { x[threadIdx.x] += 1.0f; }

static double now_s() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "short";
    if (!strcmp(mode, "init")) {
        CHECK(cudaFree(0));
        printf("{\"mode\":\"init\",\"kernels\":0}\n");
        return 0;
    }
    float *d = NULL;
    float h[32];
    CHECK(cudaMalloc(&d, 1 << 20));
    if (!strcmp(mode, "short")) {
        CHECK(cudaMemset(d, 0, 1 << 20));
        add1<<<1, 32>>>(d);
        CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
        printf("{\"mode\":\"short\",\"kernels\":1,\"memsets\":1,\"dtoh_bytes\":%zu}\n", sizeof h);
        return 0;
    }
    if (!strcmp(mode, "nosync") || !strcmp(mode, "nosync_exit")) {
        void *pinned = NULL;
        CHECK(cudaMallocHost(&pinned, 4096));
        spin<<<1, 1>>>(300ull * 1000 * 1000);
        CHECK(cudaMemcpyAsync(pinned, d, 4096, cudaMemcpyDeviceToHost, 0));
        printf("{\"mode\":\"%s\",\"kernels\":1,\"dtoh_bytes\":4096}\n", mode);
        fflush(stdout);
        if (!strcmp(mode, "nosync_exit")) _exit(0);
        return 0; /* the runtime tears down with the kernel still running */
    }
    if (!strcmp(mode, "loop")) {
        double secs = argc > 2 ? atof(argv[2]) : 2.0, t0 = now_s();
        long n = 0;
        while (now_s() - t0 < secs) {
            add1<<<1, 32>>>(d);
            CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
            n++;
        }
        printf("{\"mode\":\"loop\",\"kernels\":%ld,\"dtoh_bytes\":%ld}\n", n, n * (long)sizeof h);
        return 0;
    }
    fprintf(stderr, "cuda_prog: unknown mode %s\n", mode);
    return 2;
}
