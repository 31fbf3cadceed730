"""Two loops that fool "GPU utilisation" in opposite ways (for the busy-is-not-full table).

  python tests/gpu/busy_loops.py matmul SECONDS   # bf16 matmuls back to back: 'busy' ~100%, occupancy low
  python tests/gpu/busy_loops.py tiny SECONDS     # tiny kernels with host gaps: busy low, utilisation high-ish
"""
import sys
import time

import torch

mode, seconds = sys.argv[1], float(sys.argv[2])
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
s = torch.ones(1, device="cuda")
end = time.time() + seconds
while time.time() < end:
    if mode == "matmul":
        for _ in range(20):
            y = x @ x
        torch.cuda.synchronize()
    else:
        for _ in range(100):
            s.add_(1)
        torch.cuda.synchronize()
        time.sleep(0.001)
