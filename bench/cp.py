#!/usr/bin/env python3
"""bench/cp.py -- context-parallel NSA (nsa.distributed) on 1 and P GPUs: paper config, HQ 64,
H 4, D 128, bf16, one sequence of T tokens, forward and forward + backward.

  python3 bench/cp.py --T 128k,256k                       # one GPU: nsa.native_sparse_attention
  torchrun --nproc_per_node 2 bench/cp.py --T 128k,256k,1m  # P GPUs: nsa.distributed, NCCL

Every rank times its own call with CUDA events after warm-up (median of --reps); a row's time is
the slowest rank's. Besides the time, each P-GPU row records the bytes each rank sends (the K / V
all-gather in the forward, the dK / dV all-to-all in the backward) and the time of those
collectives run alone on the same buffers (`comm_ms`): the calls do not overlap communication
with computation yet, so all of it is exposed. Rows {"impl": "nsa", "gpus", "T", "pass", "ms",
"gpu", "comm_bytes", "comm_ms"} are appended to --out (a JSON list, made if absent, written after every row;
one file collects the 1-GPU and the P-GPU runs); a length that does not fit one GPU is recorded
with "skipped" (on P GPUs it ends the job: the other ranks would wait in a collective).
"""
import argparse
import json
import os
import sys

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="128k,256k")
    ap.add_argument("--passes", default="fwd,fwd+bwd")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON list the rows are appended to")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    import nsa
    import nsa.distributed as cp
    from cuda_timing import median_ms
    from peers import device_description

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl")
    dev = torch.device("cuda", torch.cuda.current_device())
    _, _, gpu = device_description(torch, dev)
    cfg = nsa.Config()
    rows = []
    for T in parse_T(args.T):
        L = cp.local_length(T, rank, world) if world > 1 else T
        for pass_name in args.passes.split(","):
            row = {"impl": "nsa", "gpus": world, "T": T, "pass": pass_name, "gpu": gpu}
            try:
                gen = torch.Generator(device=dev).manual_seed(1 + rank)
                q = torch.randn(1, L, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
                k = torch.randn(1, L, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
                v = torch.randn(1, L, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
                g = [torch.rand(1, L, HQ, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3)]
                grad = pass_name == "fwd+bwd"
                for x in [q, k, v] + g:
                    x.requires_grad_(grad)
                dout = torch.randn(1, L, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen) if grad else None

                def call():
                    if world > 1:
                        o = cp.native_sparse_attention(q, k, v, *g, config=cfg, seq_len=T)
                    else:
                        o = nsa.native_sparse_attention(q, k, v, *g, config=cfg)
                    if grad:
                        o.backward(dout)
                        for x in [q, k, v] + g:
                            x.grad = None
                    return o

                if not grad:
                    with torch.no_grad():
                        ms = median_ms(call, args.reps, warmup=1)
                else:
                    ms = median_ms(call, args.reps, warmup=1)
                if world > 1:
                    t = torch.tensor([ms], device=dev)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    ms = t.item()
                    # the collectives alone: all-gather of K and V, and (backward) the dK / dV all-to-all
                    longest = max(cp.local_length(T, r, world) for r in range(world))
                    kv = torch.zeros(1, longest, H, D, device=dev, dtype=torch.bfloat16)
                    parts = [torch.empty_like(kv) for _ in range(world)]
                    g32 = torch.zeros(1, longest, H, D, device=dev, dtype=torch.bfloat16)
                    pieces = [g32.clone() for _ in range(world)]
                    recv = [torch.empty_like(g32) for _ in range(world)]

                    def comm():
                        dist.all_gather(parts, kv)
                        dist.all_gather(parts, kv)
                        if grad:
                            dist.all_to_all(recv, pieces)
                            dist.all_to_all(recv, pieces)

                    cms = median_ms(comm, args.reps, warmup=1)
                    t = torch.tensor([cms], device=dev)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    row["comm_ms"] = round(t.item(), 3)
                    kv_bytes = longest * H * D * 2
                    row["comm_bytes"] = 2 * kv_bytes * (world - 1) + (2 * kv_bytes * (world - 1) if grad else 0)
                row["ms"] = round(ms, 3)
                q = k = v = dout = g = None  # freed before the next length allocates
            except torch.cuda.OutOfMemoryError as e:
                row["skipped"] = "out of memory: %s" % str(e).split("\n")[0][:120]
                if world > 1:  # the other ranks wait in a collective: end the job (torchrun stops them)
                    print(json.dumps(row), flush=True)
                    os._exit(3)
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
