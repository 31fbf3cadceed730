// launch_price.cu - what the census costs a launching thread, per call, with no Python in the way: eager launches,
// graph launches and copies, through the CUDA runtime, which takes its driver entry points through dlsym and
// cuGetProcAddress, so a preloaded census (interpose.c) wraps them as it wraps torch's. Per round, medians over ROUNDS:
//   eager_ns        one launch of an empty 1-block kernel: the launch calls alone, 256 a batch, the stream
//                   synchronised between batches (never a full queue, so the host's own time is what is timed)
//   graph_issue_ns  cudaGraphLaunch of a captured graph of 64 empty kernels, the call alone (16 a batch)
//   graph_ns        the same, to completion (the batches' wall time over their launches)
//   copy_pair_ns    4 KiB pinned HtoD + DtoH, async, 64 pairs a batch, to completion
//   control_ms      a pure-C loop: the host's speed
// and what it launched and copied, for the census's counts to be checked against:
//   launch_price ROUNDS ADDS REPLAYS PAIRS        prints one line: RESULT {...}
//   launch_price --serve ADDS REPLAYS PAIRS       two warm-up rounds, READY, then one round (RESULT {...}, that round's
//                                                 figures) for each line read from stdin; at EOF, DID {...} for the
//                                                 whole process (launch_phases.py: census modes switched between rounds)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <vector>
#include <cuda_runtime.h>
#include "clock.h"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)

__global__ void nop() {}

static cudaStream_t s;
static cudaGraphExec_t exec;
static char *h;
static char *d;
enum { BYTES = 4096, NODES = 64, EAGER_BATCH = 256, GRAPH_BATCH = 16, COPY_BATCH = 64 };

static double eager(int n) {
    double issue = 0;
    for (int done = 0; done < n;) {
        int k = std::min(n - done, (int)EAGER_BATCH);
        double t = now_ns();
        for (int i = 0; i < k; i++) nop<<<1, 1, 0, s>>>();
        issue += now_ns() - t;
        CK(cudaStreamSynchronize(s));
        done += k;
    }
    return issue / n;
}

static void graph(int n, double *issue_ns, double *total_ns) {
    double issue = 0, t0 = now_ns();
    for (int done = 0; done < n;) {
        int k = std::min(n - done, (int)GRAPH_BATCH);
        for (int i = 0; i < k; i++) {
            double t = now_ns();
            CK(cudaGraphLaunch(exec, s));
            issue += now_ns() - t;
        }
        CK(cudaStreamSynchronize(s));
        done += k;
    }
    *issue_ns = issue / n;
    *total_ns = (now_ns() - t0) / n;
}

static double copies(int n) {
    double t0 = now_ns();
    for (int done = 0; done < n;) {
        int k = std::min(n - done, (int)COPY_BATCH);
        for (int i = 0; i < k; i++) {
            CK(cudaMemcpyAsync(d, h, BYTES, cudaMemcpyHostToDevice, s));
            CK(cudaMemcpyAsync(h, d, BYTES, cudaMemcpyDeviceToHost, s));
        }
        CK(cudaStreamSynchronize(s));
        done += k;
    }
    return (now_ns() - t0) / n;
}

static double control() {
    double t = now_ns();
    volatile unsigned long long a = 0;
    for (unsigned long long i = 0; i < 2000000ULL; i++) a = a * 6364136223846793005ULL + i;
    return (now_ns() - t) / 1e6;
}

static void did(const char *tag, long long runs, int adds, int replays, int pairs) {
    printf("%s{\"eager_launches\": %lld, \"graph_launches\": %lld, \"graph_kernels\": %lld, \"htod_pinned\": [%lld, %lld], "
           "\"dtoh_pinned\": [%lld, %lld]}", tag, runs * adds, runs * replays, runs * replays * NODES, runs * pairs,
           runs * pairs * BYTES, runs * pairs, runs * pairs * BYTES);
}

int main(int argc, char **argv) {
    const bool serve = argc == 5 && std::string(argv[1]) == "--serve";
    if (argc != 5) {
        fprintf(stderr, "usage: launch_price ROUNDS ADDS REPLAYS PAIRS | launch_price --serve ADDS REPLAYS PAIRS\n");
        return 2;
    }
    const int rounds = serve ? 0 : atoi(argv[1]), adds = atoi(argv[2]), replays = atoi(argv[3]), pairs = atoi(argv[4]);
    CK(cudaSetDevice(0));
    CK(cudaStreamCreate(&s));
    CK(cudaMallocHost((void **)&h, BYTES));
    CK(cudaMalloc((void **)&d, BYTES));
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < NODES; i++) nop<<<1, 1, 0, s>>>();
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&exec, g, 0));
    double gi, gt;
    for (int w = 0; w < 2; w++) {          // warm-up: the same work as a round
        eager(adds);
        graph(replays, &gi, &gt);
        copies(pairs);
    }
    if (serve) {
        printf("READY\n");
        fflush(stdout);
        long long runs = 2;
        char line[64];
        while (fgets(line, sizeof line, stdin)) {
            double ee = eager(adds);
            graph(replays, &gi, &gt);
            double cc = copies(pairs);
            double ct = control();
            runs++;
            printf("RESULT {\"eager_ns\": %.1f, \"graph_issue_ns\": %.1f, \"graph_ns\": %.1f, \"copy_pair_ns\": %.1f, "
                   "\"control_ms\": %.3f}\n", ee, gi, gt, cc, ct);
            fflush(stdout);
        }
        CK(cudaStreamSynchronize(s));
        did("DID ", runs, adds, replays, pairs);
        printf("\n");
        fflush(stdout);
        return 0;
    }
    std::vector<double> e, issue, total, c, ctl;
    for (int r = 0; r < rounds; r++) {
        e.push_back(eager(adds));
        graph(replays, &gi, &gt);
        issue.push_back(gi);
        total.push_back(gt);
        c.push_back(copies(pairs));
        ctl.push_back(control());
    }
    CK(cudaStreamSynchronize(s));
    const long long runs = rounds + 2;
    printf("RESULT {\"eager_ns\": %.1f, \"graph_issue_ns\": %.1f, \"graph_ns\": %.1f, \"copy_pair_ns\": %.1f, "
           "\"control_ms\": %.3f, ", median(e), median(issue), median(total), median(c), median(ctl));
    did("\"did\": ", runs, adds, replays, pairs);
    printf("}\n");
    fflush(stdout);
    return 0;
}
