// clock.h - the floor programs' host clock and median (gate_floor.cu, launch_price.cu).
#pragma once
#include <algorithm>
#include <ctime>
#include <vector>

static double now_ns() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
}
