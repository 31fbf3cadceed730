// census_wait.h - for GPU workloads whose every byte a test checks: a checked workload makes its context,
// then waits (at most 10 s) for the census to say it counts (gc_active) before its first counted operation. Without the census it returns at once.
#pragma once
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// 1: counting; 0: no census in this process; -1: a census that did not start counting in 10 s.
static int census_wait(void) {
    const char *lib = getenv("CUDA_INJECTION64_PATH"), *off = getenv("OTEL_GPU_CENSUS_DISABLED");
    if (!lib || !*lib || (off && *off && strcmp(off, "0") != 0)) return 0;
    void *h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
    int (*active)(void) = h ? (int (*)(void))dlsym(h, "gc_active") : NULL;
    if (!active) return -1;
    for (int i = 0; i < 10000; i++) {
        if (active()) return 1;
        struct timespec ms = {0, 1000000L};
        nanosleep(&ms, NULL);
    }
    return -1;
}
