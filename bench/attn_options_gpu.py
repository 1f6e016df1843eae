"""attn_options_gpu.py -- GPU cost of each nsa.attention option against the plain call.

    PYTHONPATH=python python3 bench/attn_options_gpu.py [--T 16384] [--HQ 16] [--H 4] [--D 128]

bf16, B = 1, causal. The plain call runs the tuned tiles (hopper.cuh on sm_90a); any option moves
the call to the general kernels of src/cuda/xattn.cuh. Times: CUDA events after two warm-up
calls, median of --reps; forward alone and forward + backward (autograd). TFLOP/s count the
visible pairs (T^2 / 2 causal): 4 * HQ * D per pair forward, 2.5x that backward. Prints one
row per option and the GPU it ran on.
"""
import argparse

import torch

import nsa
from cuda_timing import median_ms  # bench/cuda_timing.py (this folder is on sys.path when run as a script)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--HQ", type=int, default=16)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    T, HQ, H, D = a.T, a.HQ, a.H, a.D
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(1, T, HQ, D, device=dev, dtype=dt, generator=g)
    k = torch.randn(1, T, H, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(1, T, H, D, device=dev, dtype=dt, generator=g)
    seg = (torch.arange(T, device=dev) // 4096).to(torch.int32)[None]
    rows = {
        "plain (tuned tiles)": {},
        "window 512 (tuned tiles)": dict(window=(512, 0)),
        "softcap 30": dict(softcap=30.0),
        "sinks": dict(sinks=torch.zeros(HQ, device=dev, dtype=torch.float32)),
        "segments (4096)": dict(q_segment_ids=seg, k_segment_ids=seg),
        "dropout 0.1": dict(dropout_p=0.1, seed=1),
        "softcap + window 512": dict(softcap=30.0, window=(512, 0)),
    }
    if T <= 16384:
        rows["bias [1,1,T,T] bf16"] = dict(bias=torch.randn(1, 1, T, T, device=dev, dtype=dt, generator=g))
    rows["Tq = T/8 (chunked prefill)"] = dict(tq=T // 8)
    pairs = T * (T + 1) / 2
    print(f"# {torch.cuda.get_device_name()}  T={T} HQ={HQ} H={H} D={D} bf16 causal")
    print(f"{'option':28s} {'fwd ms':>9s} {'TF/s':>6s} {'fwd+bwd ms':>11s} {'TF/s':>6s}")
    for name, opts in rows.items():
        opts = dict(opts)
        tq = opts.pop("tq", T)  # the last tq queries against all T keys (bottom-right aligned)
        qx = q[:, T - tq:].contiguous()
        win = opts.get("window", (-1, -1))
        p = min(pairs, T * (win[0] + 1)) if win[0] >= 0 else pairs
        if tq != T:
            p = tq * T - tq * (tq - 1) / 2
        f = lambda: nsa.attention(qx, k, v, causal=True, **opts)
        tf = median_ms(f, a.reps)
        qq, kk, vv = (x.detach().requires_grad_() for x in (qx, k, v))
        dout = torch.randn_like(qx[..., :D])

        def fb():
            r = nsa.attention(qq, kk, vv, causal=True, **opts)
            r.o.backward(dout)

        tb = median_ms(fb, a.reps)
        print(f"{name:28s} {tf:9.2f} {4 * HQ * D * p / tf / 1e9:6.0f} {tb:11.2f} {3.5 * 4 * HQ * D * p / tb / 1e9:6.0f}")


if __name__ == "__main__":
    main()
