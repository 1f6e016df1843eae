"""window_scan.py -- sliding-window attention forward against the window's width, nsa beside
FlexAttention, to split a window tile's cost into a fixed part and a per-chunk part.

    PYTHONPATH=python python3 bench/window_scan.py [--T 65536] [--G 16] [--H 4] [--D 128]
                                                   [--W 64,128,256,512,1024,2048,4096] [--no-flex]

bf16, B = 1, causal window of W keys (query t sees t - W + 1 .. t: nsa.attention's window =
(W - 1, 0)). CUDA events after two warm-up calls, median of --reps. TFLOP/s count the visible
pairs (4 * HQ * D per pair). The last columns fit nsa's time to a + b * chunks, where chunks =
the 128-key chunks one tile of 128 / G positions walks (a: the tile's fixed cost, b: one
chunk's), by least squares over the rows.
"""
import argparse

import torch

import nsa
from cuda_timing import median_ms  # bench/cuda_timing.py (this folder is on sys.path when run as a script)


def visible_pairs(T, W):
    full = max(T - W + 1, 0) * W          # rows that see the whole window
    ramp = min(W - 1, T)                   # the first rows see 1 .. W - 1 keys
    return full + ramp * (ramp + 1) // 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--G", type=int, default=16)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--W", default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--no-flex", action="store_true")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    T, H, D, G = a.T, a.H, a.D, a.G
    HQ = H * G
    gen = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(1, T, HQ, D, device=dev, dtype=dt, generator=gen)
    k = torch.randn(1, T, H, D, device=dev, dtype=dt, generator=gen)
    v = torch.randn(1, T, H, D, device=dev, dtype=dt, generator=gen)
    flex = None
    if not a.no_flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            flex = torch.compile(flex_attention, dynamic=False)
            qf, kf, vf = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [1, heads, T, D]
        except Exception as e:  # noqa: BLE001
            print("flex: unavailable (%s)" % e)
            flex = None
    print("window scan: %s, T %d, HQ %d, H %d, D %d, bf16, forward, median of %d" % (
        torch.cuda.get_device_name(), T, HQ, H, D, a.reps))
    print("%6s %7s %10s %9s %10s %9s %9s" % ("W", "chunks", "nsa ms", "TFLOP/s", "flex ms", "TFLOP/s", "flex/nsa"))
    pos_per_tile = max(128 // G, 1)
    xs, ys = [], []
    for W in [int(x) for x in a.W.split(",")]:
        flops = 4.0 * HQ * D * visible_pairs(T, W)
        t_nsa = median_ms(lambda: nsa.attention(q, k, v, causal=True, window=(W - 1, 0)), a.reps)
        chunks = (W - 1 + pos_per_tile + 127) // 128
        xs.append(chunks)
        ys.append(t_nsa)
        t_flex = None
        if flex is not None:
            try:
                def swa(b, h, qi, ki, W=W):
                    return (qi >= ki) & (qi - ki < W)
                bm = create_block_mask(swa, B=None, H=None, Q_LEN=T, KV_LEN=T, device=dev)
                t_flex = median_ms(lambda: flex(qf, kf, vf, block_mask=bm, enable_gqa=True), a.reps)
            except Exception as e:  # noqa: BLE001
                print("flex W=%d failed: %s" % (W, str(e).splitlines()[0][:160]))
        print("%6d %7d %10.3f %9.1f %10s %9s %9s" % (
            W, chunks, t_nsa, flops / t_nsa / 1e9,
            "%.3f" % t_flex if t_flex else "-", "%.1f" % (flops / t_flex / 1e9) if t_flex else "-",
            "%.2f" % (t_flex / t_nsa) if t_flex else "-"))
    n = len(xs)
    if n >= 2:
        mx, my = sum(xs) / n, sum(ys) / n
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-9)
        a0 = my - b * mx
        tiles = (T * G + 127) // 128 * H
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        per = tiles / sms  # tiles per SM (one CTA per SM)
        print("fit nsa ms = %.3f + %.3f * chunks: per tile %.2f us fixed + %.2f us per chunk (%d tiles, %d SMs)" % (
            a0, b, a0 * 1e3 / per, b * 1e3 / per, tiles, sms))


if __name__ == "__main__":
    main()
