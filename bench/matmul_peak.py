"""matmul_peak.py -- the measured bf16 matmul peak that the per-branch utilisation targets are
fractions of: torch.matmul on square bf16 matrices (random, not zeros), CUDA events after
warm-up, median of --reps, the best size reported.

    python3 bench/matmul_peak.py [--sizes 4096,8192,16384] [--reps 20]
"""
import argparse

import torch

from cuda_timing import median_ms  # bench/cuda_timing.py


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,8192,16384")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    print("matmul peak: %s, bf16 in, bf16 out (fp32 accumulate), median of %d" % (torch.cuda.get_device_name(), a.reps))
    best = 0.0
    for n in [int(x) for x in a.sizes.split(",")]:
        x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        y = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        ms = median_ms(lambda: torch.matmul(x, y), a.reps, warmup=5)
        tf = 2.0 * n ** 3 / ms / 1e9
        best = max(best, tf)
        print("  %6d x %-6d %8.3f ms  %6.1f TFLOP/s" % (n, n, ms, tf))
    print("peak %.1f TFLOP/s" % best)


if __name__ == "__main__":
    main()
