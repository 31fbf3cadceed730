/* eager_path.c - what the preloaded census (interpose.c) adds to one eager cuLaunchKernel, on a CPU: the mock driver
 * (native/tests/mock_cuda.c, a libcuda.so.1) stands in for libcuda, so only the wrapper's own work differs between
 * the two loops timed.
 *
 *   eager_path MOCK_LIBCUDA N ROUNDS [--init] [--threads T]
 *   eager_path MOCK_LIBCUDA N 1 --init --placement K
 *
 * The driver is looked up as the CUDA runtime does (dlsym of cuGetProcAddress_v2, then cuLaunchKernel through it): with
 * the census preloaded that is its wrapper. `direct` is the mock's own cuLaunchKernel, found with dlsym(RTLD_NEXT, ...),
 * which the census passes through untouched. --init calls InitializeInjection (the census's mode: its environment).
 * Each round times N direct calls and N wrapped ones, in alternating order, on each of T threads at once (ns per call:
 * the threads' mean). One line: RESULT {"direct_ns": [...], "wrapped_ns": [...], "wrapped_ok": ..., ...}, where
 * wrapped_ok counts the wrapped calls that succeeded (a counting census must count exactly these), warm-up included.
 * --placement: no timing; K bursts of N wrapped launches, each in its own 20 ms window of the census clock at a phase
 * that cycles through the window (its first and last ms included), for the census's launch windows to be checked:
 * RESULT {"placement": [[window index, launches], ...], ...}. The census clock is CLOCK_MONOTONIC plus the
 * (CLOCK_REALTIME - CLOCK_MONOTONIC) the census read at start (ACTIVITY=off or events), which no clock slew moves.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                         void **);
typedef int (*gpa_fn)(const char *, void **, int, unsigned long long, int *);

static launch_fn g_direct, g_wrapped;
static long g_n;
static pthread_barrier_t g_go;

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* n launches through f; ns per call, failed calls to *bad */
static double loop(launch_fn f, long n, long *bad)
{
    long b = 0;
    double t = now_ns();
    for (long i = 0; i < n; i++) b += f((void *)0x1234, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) != 0;
    double ns = (now_ns() - t) / (double)n;
    *bad += b;
    return ns;
}

struct job { int wrapped; double ns; long bad; };

static void *worker(void *arg)
{
    struct job *j = arg;
    pthread_barrier_wait(&g_go);
    j->ns = loop(j->wrapped ? g_wrapped : g_direct, g_n, &j->bad);
    return NULL;
}

/* one phase on T threads at once (T == 1: this thread); the threads' mean ns per call */
static double phase(int wrapped, int threads, long *bad)
{
    if (threads == 1) return loop(wrapped ? g_wrapped : g_direct, g_n, bad);
    pthread_t th[64];
    struct job jobs[64];
    pthread_barrier_init(&g_go, NULL, (unsigned)threads);
    for (int i = 0; i < threads; i++) {
        jobs[i] = (struct job){wrapped, 0, 0};
        if (pthread_create(&th[i], NULL, worker, &jobs[i]) != 0) { perror("pthread_create"); exit(1); }
    }
    double sum = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(th[i], NULL);
        sum += jobs[i].ns;
        *bad += jobs[i].bad;
    }
    pthread_barrier_destroy(&g_go);
    return sum / threads;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void list(const char *key, const double *v, int n)
{
    printf("\"%s\": [", key);
    for (int i = 0; i < n; i++) printf("%s%.2f", i ? ", " : "", v[i]);
    printf("], ");
}

#define WINDOW_NS 20000000LL

static long long mono_ll(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* K bursts of n wrapped launches, each well inside one window of the census clock (see above); the windows printed */
static int placement(int k, long n)
{
    static const long long phase_us[] = {300, 1000, 2500, 4000, 6000, 10000, 12500, 14000, 16000, 18000, 19000, 19600};
    struct timespec w;
    long long m0 = mono_ll();
    clock_gettime(CLOCK_REALTIME, &w);
    long long m1 = mono_ll(), off = w.tv_sec * 1000000000LL + w.tv_nsec - (m0 + (m1 - m0) / 2);
    long ok = 0, bad = 0;
    printf("RESULT {\"placement\": [");
    for (int i = 0; i < k; i++) {
        long long phase = phase_us[i % (int)(sizeof(phase_us) / sizeof(phase_us[0]))] * 1000, now = mono_ll() + off;
        long long target = now / WINDOW_NS * WINDOW_NS + WINDOW_NS + phase;   /* the next window, at that phase */
        long long wake = target - off - 5000000;   /* then busy: the coarse clock ticks on as in a busy server */
        struct timespec ts = {(time_t)(wake / 1000000000LL), (long)(wake % 1000000000LL)};
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
        while (mono_ll() + off < target) {}
        long b0 = bad;
        long long t0 = mono_ll() + off;
        for (long j = 0; j < n; j++) bad += g_wrapped((void *)0x1234, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) != 0;
        long long t1 = mono_ll() + off;
        if (t0 / WINDOW_NS != t1 / WINDOW_NS || t1 % WINDOW_NS > WINDOW_NS - 100000) {
            fprintf(stderr, "eager_path: a burst of %ld launches ran past its window's last 100 us\n", n);
            return 1;
        }
        ok += n - (bad - b0);
        printf("%s[%lld, %ld]", i ? ", " : "", t0 / WINDOW_NS, n - (bad - b0));
    }
    printf("], \"wrapped_ok\": %ld, \"wrapped_is_direct\": %s, \"offset_ns\": %lld}\n", ok,
           g_wrapped == g_direct ? "true" : "false", off);
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: eager_path MOCK_LIBCUDA N ROUNDS [--init] [--threads T] [--placement K]\n");
        return 2;
    }
    g_n = atol(argv[2]);
    int rounds = atoi(argv[3]), init = 0, threads = 1, bursts = 0;
    for (int i = 4; i < argc; i++) {
        if (strcmp(argv[i], "--init") == 0) init = 1;
        else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--placement") == 0 && i + 1 < argc) bursts = atoi(argv[++i]);
        else { fprintf(stderr, "eager_path: unknown argument %s\n", argv[i]); return 2; }
    }
    if (g_n <= 0 || rounds <= 0 || rounds > 1000 || threads < 1 || threads > 64) {
        fprintf(stderr, "eager_path: N > 0, 0 < ROUNDS <= 1000, 1 <= T <= 64\n");
        return 2;
    }
    void *cuda = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    if (!cuda) { fprintf(stderr, "eager_path: %s\n", dlerror()); return 1; }
    gpa_fn gpa = (gpa_fn)dlsym(cuda, "cuGetProcAddress_v2");
    void (*set_call_ns)(unsigned long long) = (void (*)(unsigned long long))dlsym(cuda, "mock_cuda_set_call_ns");
    void *p = NULL;
    int st = 0;
    if (!gpa || !set_call_ns || gpa("cuLaunchKernel", &p, 13000, 0, &st) != 0 || !p) {
        fprintf(stderr, "eager_path: %s is not the mock driver\n", argv[1]);
        return 1;
    }
    g_wrapped = (launch_fn)p;
    g_direct = (launch_fn)dlsym(RTLD_NEXT, "cuLaunchKernel");
    if (!g_direct) { fprintf(stderr, "eager_path: no cuLaunchKernel after the program\n"); return 1; }
    set_call_ns(0);   /* the mock's launch returns at once (2 us of spinning otherwise) */
    int (*initialize)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "InitializeInjection");
    if (init && !initialize) { fprintf(stderr, "eager_path: --init without the census preloaded\n"); return 1; }
    if (init) initialize();
    if (bursts > 0) return placement(bursts, g_n);

    long bad_direct = 0, bad_wrapped = 0;
    double *d = calloc((size_t)rounds, sizeof(double)), *w = calloc((size_t)rounds, sizeof(double));
    if (!d || !w) return 1;
    phase(0, threads, &bad_direct);   /* warm-up: one round of each */
    phase(1, threads, &bad_wrapped);
    for (int r = 0; r < rounds; r++) {
        if (r % 2) {
            w[r] = phase(1, threads, &bad_wrapped);
            d[r] = phase(0, threads, &bad_direct);
        } else {
            d[r] = phase(0, threads, &bad_direct);
            w[r] = phase(1, threads, &bad_wrapped);
        }
    }
    long calls = (long)(rounds + 1) * g_n * threads;
    printf("RESULT {");
    list("direct_ns", d, rounds);
    list("wrapped_ns", w, rounds);
    double *diff = calloc((size_t)rounds, sizeof(double));
    if (!diff) return 1;
    for (int r = 0; r < rounds; r++) diff[r] = w[r] - d[r];
    qsort(d, (size_t)rounds, sizeof(double), cmp);
    qsort(w, (size_t)rounds, sizeof(double), cmp);
    qsort(diff, (size_t)rounds, sizeof(double), cmp);
    printf("\"direct_median_ns\": %.2f, \"wrapped_median_ns\": %.2f, \"added_median_ns\": %.2f, "
           "\"added_min_ns\": %.2f, \"added_max_ns\": %.2f, \"wrapped_is_direct\": %s, \"threads\": %d, \"n\": %ld, "
           "\"rounds\": %d, \"wrapped_ok\": %ld, \"direct_ok\": %ld, \"initialized\": %s}\n",
           d[rounds / 2], w[rounds / 2], diff[rounds / 2], diff[0], diff[rounds - 1],
           g_wrapped == g_direct ? "true" : "false", threads, g_n, rounds, calls - bad_wrapped, calls - bad_direct,
           init ? "true" : "false");
    fflush(stdout);
    free(d);
    free(w);
    free(diff);
    return 0;
}
