#!/usr/bin/env python3
"""bench/decode.py -- one decode step (one new token per sequence) of nsa against the public NSA
decode kernel and dense attention, one process, one GPU, bf16, paged caches.

  nsa     nsa.step: the three branches over paged token and compressed caches (paper config),
          the compressed rows kept by the caller (no block completes in the timed step); and
          nsa.attention_step (dense, causal) over the same token cache
  mdy666  flash_nsa.inference.nsa_decode (mdy666/Scalable-Flash-Native-Sparse-Attention, Triton,
          page 128, mean pooling; cmp_slot_mapping -1: no compressed row completes either)
  cudnn   torch SDPA, cuDNN backend, dense: the G query heads of a kv head as G query rows
          against its K / V (non-causal: a decode query sees every cached key), no head copies
  fa2     the same through SDPA's flash backend (FlashAttention-2 kernels)

Each at B in --batch (1, 8, 32) and contexts --ctx (16k, 64k, 128k), HQ 64, H 4, D 128, eager
and as a captured CUDA graph replayed (--graph). Timing: CUDA events after warm-up, the L2
flushed before every run (256 MB zeroed), median of --reps runs. The byte floor of a step is the
K / V bytes it must read at the GPU's HBM bandwidth (--bandwidth, default from the GPU's name):
dense B * ctx * H * D * 2 (K and V) * 2 bytes; NSA per kv head the Nc compressed rows, the n
selected blocks of l' tokens and the w window (K and V), as the decode targets count them (bench/PEERS.md).

Peers from $NSA_PEERS (default <repo>/peers; scripts/fetch-peers.sh); an absent or failing
peer is recorded as skipped, never fatal.

  python3 bench/decode.py --out bench/results          # the table, <out>/<date>-<gpu>-decode.json
  python3 bench/decode.py --self-test                  # the pure parts, no GPU
  python3 bench/decode.py --device cpu --batch 1 --ctx 4k --impl nsa   # the nsa rows on the CPU
"""
import argparse
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "python"))
import peers as harness  # noqa: E402  (device_description, gpu_slug, parse_T, fmt_T, write_json, Skip, package loading)

HQ, H, D = 64, 4, 128
PAPER = dict(cmp_len=32, cmp_stride=16, slc_block=64, slc_topk=16, n_init=1, n_local=2, window=512)
PAGE = 128  # mdy666's page size must be a multiple of 128; nsa takes any
IMPLS = ("nsa", "mdy666", "cudnn", "fa2")
# HBM bandwidth (bytes/s) by GPU name, for the byte floor
BANDWIDTH = {"h100": 3.35e12, "h200": 4.8e12, "a100": 2.0e12, "h800": 3.35e12, "h20": 4.0e12}


def nsa_rows_read(ctx, cfg=PAPER):
    """K/V rows one kv head of a decode query reads: the visible compressed rows, the selected
    blocks' tokens and the window (each capped at the context)."""
    nc = max((ctx - cfg["cmp_len"]) // cfg["cmp_stride"] + 1, 0)
    return nc + min(cfg["slc_topk"] * cfg["slc_block"], ctx) + min(cfg["window"], ctx)


def floor_us(op, B, ctx, bandwidth):
    """The step's byte floor in microseconds: K and V rows read once, bf16."""
    rows = ctx if op == "dense" else nsa_rows_read(ctx)
    return B * H * rows * D * 2 * 2 / bandwidth * 1e6


def make_row(impl, op, B, ctx, graph, us, floor, gpu):
    return {"impl": impl, "op": op, "B": B, "ctx": ctx, "graph": graph, "us": round(us, 2), "floor_us": round(floor, 2),
            "gpu": gpu}


def format_table(rows, skipped=()):
    lines = ["%-7s %-5s %3s %6s %-5s %10s %10s %8s" % ("impl", "op", "B", "ctx", "graph", "us", "floor us", "floor %")]
    for r in sorted(rows, key=lambda r: (r["B"], r["ctx"], r["op"] != "nsa", r["graph"], IMPLS.index(r["impl"]))):
        lines.append("%-7s %-5s %3d %6s %-5s %10.1f %10.1f %7.0f%%" % (
            r["impl"], r["op"], r["B"], harness.fmt_T(r["ctx"]), "yes" if r["graph"] else "no", r["us"], r["floor_us"],
            100.0 * r["floor_us"] / r["us"] if r["us"] > 0 else 0.0))
    for s in skipped:
        lines.append("skipped: %s" % s)
    lines.append("floor %: the byte floor over the measured time (100% = reads K/V at HBM bandwidth)")
    return "\n".join(lines)


def bandwidth_of(name, given):
    if given:
        return given
    slug = harness.gpu_slug(name or "")
    return BANDWIDTH.get(slug, 3.35e12)


def self_test():
    fails = 0

    def check(cond, what):
        nonlocal fails
        print("%s %s" % ("ok  " if cond else "FAIL", what))
        fails += not cond

    check(nsa_rows_read(65536) == 4095 + 1024 + 512, "64k: 4095 compressed rows + 16 x 64 + 512 (the targets' count)")
    check(nsa_rows_read(100) == 5 + 100 + 100, "a short context caps the blocks and the window")
    f = floor_us("dense", 32, 65536, 3.35e12)
    check(abs(f - 1282.0) < 1.0, "dense floor B=32 64k on an H100: %.1f us (1282 in the targets)" % f)
    f = floor_us("nsa", 1, 65536, 3.35e12)
    check(abs(f - 3.4) < 0.1, "nsa floor B=1 64k: %.2f us (3.4 in the targets)" % f)
    r = make_row("nsa", "nsa", 8, 65536, True, 40.0, 27.5, "H100")
    check(set(r) == {"impl", "op", "B", "ctx", "graph", "us", "floor_us", "gpu"}, "row keys")
    t = format_table([r, make_row("mdy666", "nsa", 8, 65536, True, 94.8, 27.5, "H100")], ["fa2 B=1: no flash"])
    check("69%" in t and "skipped: fa2" in t, "table: the floor fraction and the skips")
    check(bandwidth_of("NVIDIA H200", None) == 4.8e12 and bandwidth_of("x", 1e12) == 1e12, "bandwidth by name / given")
    check(json.loads(json.dumps([r]))[0] == r, "JSON round trip")
    print("%d passed, %d failed" % (8 - fails, fails))
    return 1 if fails else 0


class Bench:
    def __init__(self, torch, args, device):
        self.torch, self.args, self.dev = torch, args, device
        self.timer = harness.Timer(torch, device, args.reps, args.warmup)

    def time_us(self, fn):
        """Median microseconds of fn (harness.Timer: CUDA events, L2 flushed before each run)."""
        return self.timer.ms(fn) * 1000.0

    def graphed(self, fn):
        """fn captured once in a CUDA graph (after a warm-up run on the capture stream); the replay."""
        torch = self.torch
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay

    def caches(self, B, ctx):
        """Paged token and compressed caches (random bf16, shuffled pages) shared by nsa and mdy666:
        mdy666 keeps both in one pool, so the compressed pages follow the token pages there."""
        torch = self.torch
        dt = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        nc = max((ctx - PAPER["cmp_len"]) // PAPER["cmp_stride"] + 1, 0)
        tp, cp = -(-ctx // PAGE), max(1, -(-nc // PAGE))
        pool = B * (tp + cp)
        g = torch.Generator(device="cpu").manual_seed(0)
        perm = torch.randperm(pool, generator=g).to(torch.int32)
        k = torch.randn(pool, PAGE, H, D, dtype=dt, device=self.dev)
        v = torch.randn(pool, PAGE, H, D, dtype=dt, device=self.dev)
        bt = perm[:B * tp].view(B, tp).to(self.dev)
        cbt = perm[B * tp:].view(B, cp).to(self.dev)
        return dict(k=k, v=v, bt=bt, cbt=cbt, nc=nc, dt=dt)

    def nsa_fn(self, B, ctx, c):
        import nsa
        torch = self.torch
        cfg = nsa.Config(**PAPER)
        q = torch.randn(B, 1, HQ, D, dtype=c["dt"], device=self.dev)
        gates = [torch.rand(B, 1, HQ, dtype=c["dt"], device=self.dev) for _ in range(3)]
        seqlens = torch.full((B,), ctx, dtype=torch.int32, device=self.dev)  # the query is the last cached token
        cache, cmp_cache = (c["k"], c["v"], c["bt"]), (c["k"], c["v"], c["cbt"])
        return lambda: nsa.step(q, cache, seqlens, cfg, cmp_cache=cmp_cache, cmp_by_caller=True, g_cmp=gates[0],
                                g_slc=gates[1], g_swa=gates[2])

    def nsa_dense_fn(self, B, ctx, c):
        import nsa
        torch = self.torch
        q = torch.randn(B, 1, HQ, D, dtype=c["dt"], device=self.dev)
        seqlens = torch.full((B,), ctx, dtype=torch.int32, device=self.dev)
        return lambda: nsa.attention_step(q, (c["k"], c["v"], c["bt"]), seqlens, causal=True)

    def mdy666_fn(self, B, ctx, c):
        if self.dev.type != "cuda":
            raise harness.Skip("mdy666 runs on CUDA only")
        torch = self.torch
        peers = os.environ.get("NSA_PEERS") or os.path.join(REPO, "peers")
        root = os.path.join(peers, "mdy666")
        if not os.path.isfile(os.path.join(root, "flash_nsa", "inference", "__init__.py")):
            raise harness.Skip("peer mdy666 absent: no %s/flash_nsa/inference (bash scripts/fetch-peers.sh)" % root)
        if root not in sys.path:
            sys.path.insert(0, root)
        try:
            from flash_nsa.inference import nsa_decode
        except Exception as e:  # its package __init__ imports training parts: load the inference part alone
            harness._drop_modules("flash_nsa")
            harness._bare_package("flash_nsa", os.path.join(root, "flash_nsa"))
            try:
                from flash_nsa.inference import nsa_decode
            except Exception as e2:
                raise harness.Skip("flash_nsa.inference does not import: %s; bare: %s" % (e, e2))
        q = torch.randn(B, HQ, D, dtype=c["dt"], device=self.dev)
        w = torch.randn(B, HQ, 3, dtype=c["dt"], device=self.dev)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=self.dev)
        slot = torch.full((B,), -1, dtype=torch.int32, device=self.dev)
        fixed_nb, fixed_y = -(-ctx // PAPER["slc_block"]), max(c["nc"], 1)
        kw = dict(fixed_num_slc_blocks=fixed_nb, fixed_y_maxlen=fixed_y, kernel_size=PAPER["cmp_len"],
                  stride=PAPER["cmp_stride"], block_size=PAPER["slc_block"], top_n=PAPER["slc_topk"],
                  num_init_blocks=PAPER["n_init"], num_local_blocks=PAPER["n_local"], window_size=PAPER["window"])
        return lambda: nsa_decode(q, c["k"], c["v"], w, context_lens=lens, block_tables=c["bt"],
                                  cmp_slot_mapping=slot, cmp_block_tables=c["cbt"], **kw)

    def sdpa_fn(self, B, ctx, backend):
        if self.dev.type != "cuda":
            raise harness.Skip("%s runs on CUDA only" % backend)
        torch = self.torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[backend]
        G = HQ // H
        q = torch.randn(B, H, G, D, dtype=torch.bfloat16, device=self.dev)  # a kv head's G query heads as rows
        k = torch.randn(B, H, ctx, D, dtype=torch.bfloat16, device=self.dev)
        v = torch.randn(B, H, ctx, D, dtype=torch.bfloat16, device=self.dev)

        def fn():
            with sdpa_kernel(be):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return fn


def run(args):
    import torch
    device = torch.device(args.device)
    info, name, gpu = harness.device_description(torch, device)
    bw = bandwidth_of(name, args.bandwidth)
    print("gpu: %s; byte floor at %.2f TB/s" % (gpu, bw / 1e12), flush=True)
    bench = Bench(torch, args, device)
    rows, skipped = [], []
    for B in args.batch:
        for ctx in args.ctx:
            try:
                c = bench.caches(B, ctx) if {"nsa", "mdy666"} & set(args.impl) else None
            except Exception as e:  # out of memory: the larger shapes will not fit either
                skipped.append("B=%d ctx=%s: caches: %s" % (B, harness.fmt_T(ctx), str(e).splitlines()[0]))
                continue
            plan = []
            if "nsa" in args.impl:
                plan += [("nsa", "nsa", lambda: bench.nsa_fn(B, ctx, c)), ("nsa", "dense", lambda: bench.nsa_dense_fn(B, ctx, c))]
            if "mdy666" in args.impl:
                plan.append(("mdy666", "nsa", lambda: bench.mdy666_fn(B, ctx, c)))
            for be in ("cudnn", "fa2"):
                if be in args.impl:
                    plan.append((be, "dense", lambda be=be: bench.sdpa_fn(B, ctx, be)))
            for impl, op, make in plan:
                for graph in ([False, True] if args.graph and device.type == "cuda" else [False]):
                    what = "%s %s B=%d ctx=%s%s" % (impl, op, B, harness.fmt_T(ctx), " graph" if graph else "")
                    try:
                        fn = make()
                        fn()
                        if graph:
                            fn = bench.graphed(fn)
                        us = bench.time_us(fn)
                    except harness.Skip as e:
                        skipped.append("%s: %s" % (what, e))
                        break
                    except Exception as e:
                        skipped.append("%s: %s: %s" % (what, type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
                        if args.verbose:
                            traceback.print_exc()
                        continue
                    rows.append(make_row(impl, op, B, ctx, graph, us, floor_us(op, B, ctx, bw), name))
                    print("  %-40s %10.1f us" % (what, us), flush=True)
            c = None  # (the caches freed before the next shape)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print()
    print(format_table(rows, skipped))
    if args.out:
        stem = harness.write_results(args.out, name, "decode", rows, {
            "gpu": gpu, "nvidia_smi": info, "bandwidth": bw, "skipped": skipped,
            "argv": harness.record_argv(sys.argv, args.out), "torch": torch.__version__,
            "timing": "CUDA events, L2 flushed (256 MB zeroed), median of %d runs after %d warm-up runs" % (args.reps,
                                                                                                        args.warmup)})
        print("wrote %s.json and %s.meta.json" % (stem, stem))
    return 0


def profile(args):
    """Per-kernel CUDA time of nsa's NSA and dense steps (torch.profiler; no L2 flush): where a
    step's microseconds go, by kernel, averaged over --reps calls after --warmup."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile
    bench = Bench(torch, args, torch.device(args.device))
    for B in args.batch:
        for ctx in args.ctx:
            c = bench.caches(B, ctx)
            for name, fn in (("nsa", bench.nsa_fn(B, ctx, c)), ("dense", bench.nsa_dense_fn(B, ctx, c))):
                for _ in range(args.warmup):
                    fn()
                torch.cuda.synchronize()
                with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.reps):
                        fn()
                    torch.cuda.synchronize()
                dev_us = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)  # noqa: E731
                rows = [(e.key, dev_us(e) / args.reps) for e in prof.key_averages() if dev_us(e) > 0]
                rows.sort(key=lambda r: -r[1])
                print("%s step B=%d ctx=%s: %.1f us of kernels per call" % (name, B, harness.fmt_T(ctx), sum(r[1] for r in rows)))
                for key, us in rows[:8]:
                    print("  %8.1f us  %s" % (us, key[:90]))
            del c
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8,32", help="batch sizes, comma-separated")
    ap.add_argument("--ctx", default="16k,64k,128k", help="cached tokens per sequence, comma-separated")
    ap.add_argument("--impl", default=",".join(IMPLS), help="of %s" % ", ".join(IMPLS))
    ap.add_argument("--no-graph", dest="graph", action="store_false", help="eager runs only")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--bandwidth", type=float, default=None, help="HBM bytes/s for the floor (default by GPU name)")
    ap.add_argument("--out", default=None, help="folder for <date>-<gpu>-decode.json")
    ap.add_argument("--profile", action="store_true", help="nsa's steps only: CUDA time per kernel (torch.profiler)")
    ap.add_argument("--self-test", action="store_true", help="the pure parts only (no torch, no GPU)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    args.batch = [int(x) for x in args.batch.split(",") if x]
    args.ctx = harness.parse_T(args.ctx)
    args.impl = [x for x in args.impl.split(",") if x]
    bad = [x for x in args.impl if x not in IMPLS]
    if bad:
        ap.error("--impl: unknown %s (known: %s)" % (", ".join(bad), ", ".join(IMPLS)))
    if args.profile:
        return profile(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
