"""cuda_timing.py -- the one timing rule of the small GPU benchmarks in bench/ (window_scan.py,
attn_options_gpu.py, matmul_peak.py, cp.py): `warmup` untimed calls, then `reps` calls each between
two CUDA events on the current stream, synchronised, the median in milliseconds.
(bench/peers.py keeps its own, with a time budget per measurement.)"""
import statistics

import torch


def median_ms(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
