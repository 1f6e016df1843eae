#!/usr/bin/env python3
"""bench/cp.py -- context-parallel NSA (nsa.distributed) on 1 and P GPUs: paper config, HQ 64,
H 4, D 128, bf16, one sequence of T tokens, forward and forward + backward.

  python3 bench/cp.py --T 128k,256k                       # one GPU: nsa.native_sparse_attention
  torchrun --nproc_per_node 2 bench/cp.py --T 128k,256k,1m  # P GPUs: nsa.distributed, NCCL
  torchrun --nproc_per_node 2 bench/cp.py --device cpu --T 2k --shape 4,1,32 --reps 2
                                                           # the CPU, gloo, float32: the code paths only

Every rank times its own call after a warm-up (CUDA events; the wall clock on the CPU), the median
of --reps; a row's time is the slowest rank's. Each P-GPU row times the call with its
communication overlapped with computation (`ms`, the default) and without (`ms_no_overlap`:
overlap=False, which waits for each collective as soon as it is issued), the two in turns, rep by
rep, so that drift hits both alike; then the call's collectives alone on buffers of the same
sizes (`comm_ms`: the K / V all-gathers, and in the backward the dK / dV all-to-alls) and the bytes
a rank sends to the others (`comm_bytes`, the largest over the ranks). `comm_hidden` =
(ms_no_overlap - ms) / comm_ms, clamped to [0, 1]: the share of the communication the overlap
hides (noisy where the collectives are a small part of the step; the first gather and the last
exchange stay exposed by construction, so it tops out near 0.5 forward and 0.6 forward +
backward: bench/NOTES.md). Rows {"impl": "nsa", "gpus",
"T", "pass", "ms", "gpu"} (P-GPU rows with "ms_no_overlap", "comm_ms", "comm_bytes",
"comm_hidden") are appended to --out (a JSON list, made if absent, written after every row; one
file collects the 1-GPU and the P-GPU runs); a length that does not fit one GPU is recorded with
"skipped" (on P GPUs it ends the job: the other ranks would wait in a collective).
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

HQ, H, D = 64, 4, 128


def parse_T(text):
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        mult = 1024 * 1024 if p.endswith("m") else 1024 if p.endswith("k") else 1
        out.append(int(float(p.rstrip("mk")) * mult))
    return out


def append_row(path, row):
    """Adds one row to the JSON list at path (made if absent), after every measurement."""
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    with open(path + ".tmp", "w") as f:
        json.dump(old + [row], f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def in_turns_ms(fns, reps, dev):
    """The median time in ms of each of fns after one warm-up call each, timed in turns (one call
    of each a rep) so that drift hits them alike: CUDA events on a GPU, the wall clock on the CPU."""
    from cuda_timing import median_ms

    def once(fn):
        if dev.type == "cuda":
            return median_ms(fn, 1, warmup=0)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for t, fn in zip(times, fns):
            t.append(once(fn))
    return [statistics.median(t) for t in times]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="128k,256k")
    ap.add_argument("--passes", default="fwd,fwd+bwd")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: gloo and float32, to exercise the code paths, not to time them")
    ap.add_argument("--shape", default="%d,%d,%d" % (HQ, H, D), help="HQ,H,D (default the paper's)")
    ap.add_argument("--out", default=None, help="JSON list the rows are appended to")
    args = ap.parse_args()
    hq, h, d = (int(x) for x in args.shape.split(","))

    import torch
    import torch.distributed as dist

    import nsa
    import nsa.distributed as cp
    from peers import device_description

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = args.device == "cuda"
    if world > 1:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    _, _, gpu = device_description(torch, dev)
    cfg = nsa.Config()

    def slowest(values):
        """Each value's maximum over the ranks."""
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    rows = []
    for T in parse_T(args.T):
        L = cp.local_length(T, rank, world) if world > 1 else T
        for pass_name in args.passes.split(","):
            row = {"impl": "nsa", "gpus": world, "T": T, "pass": pass_name, "gpu": gpu}
            try:
                gen = torch.Generator(device=dev).manual_seed(1 + rank)
                q = torch.randn(1, L, hq, d, device=dev, dtype=dtype, generator=gen)
                k = torch.randn(1, L, h, d, device=dev, dtype=dtype, generator=gen)
                v = torch.randn(1, L, h, d, device=dev, dtype=dtype, generator=gen)
                g = [torch.rand(1, L, hq, device=dev, dtype=dtype, generator=gen) for _ in range(3)]
                grad = pass_name == "fwd+bwd"
                for x in [q, k, v] + g:
                    x.requires_grad_(grad)
                dout = torch.randn(1, L, hq, d, device=dev, dtype=dtype, generator=gen) if grad else None

                def step(overlap=True):
                    with torch.set_grad_enabled(grad):
                        if world > 1:
                            o = cp.native_sparse_attention(q, k, v, *g, config=cfg, seq_len=T, overlap=overlap)
                        else:
                            o = nsa.native_sparse_attention(q, k, v, *g, config=cfg)
                        if grad:
                            o.backward(dout)
                            for x in [q, k, v] + g:
                                x.grad = None

                if world == 1:
                    row["ms"] = round(in_turns_ms([step], args.reps, dev)[0], 3)
                else:
                    ms, ms_no = slowest(in_turns_ms([step, lambda: step(False)], args.reps, dev))
                    comm, sent = cp._collectives_alone(k, v, T, backward=grad)
                    cms, sent = slowest([in_turns_ms([comm], args.reps, dev)[0], sent])
                    row.update(ms=round(ms, 3), ms_no_overlap=round(ms_no, 3), comm_ms=round(cms, 3),
                               comm_bytes=int(sent),
                               comm_hidden=round(min(1.0, max(0.0, (ms_no - ms) / cms)), 3) if cms > 0 else None)
                    comm = None
                q = k = v = dout = g = None  # freed before the next length allocates
            except torch.cuda.OutOfMemoryError as e:
                row["skipped"] = "out of memory: %s" % str(e).split("\n")[0][:120]
                if world > 1:  # the other ranks wait in a collective: end the job (torchrun stops them)
                    print(json.dumps(row), flush=True)
                    os._exit(3)
            if cuda:
                torch.cuda.empty_cache()
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
                if args.out:
                    append_row(args.out, row)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
