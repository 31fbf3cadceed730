// spin.cuh - a kernel that spins a known time on the GPU's global timer (0: returns at once), so that measured
// kernel durations have a known answer (tests/gpu/steady.cu).
#pragma once

__global__ void spin_kernel(unsigned long long spin_ns) {
    if (!spin_ns) return;
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < spin_ns);
}
