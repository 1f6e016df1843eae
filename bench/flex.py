#!/usr/bin/env python3
"""bench/flex.py -- block-sparse attention with mods: nsa.flex_attention against torch's
FlexAttention (compiled) on the same mods, one process, one GPU, bf16, D = 128.

Mods (FlexAttention's own examples): causal, sliding window 1024, prefix-LM (first 2048 keys
open), document masking (documents of 4096 tokens), ALiBi, tanh softcap 30, a relative-position
bias table -- the last three on a causal mask. T in --T (4k, 16k, 64k), heads HQ 16 (H 16) and
GQA 64 / 4, forward and forward + backward. TFLOP/s count the visible pairs only (4 * D flops
per pair forward, 2.5x that for forward + backward), from closed forms per mod. Timing: CUDA
events after warm-up, the L2 flushed before each run, median of --reps runs. A failing row
(out of memory, not supported) is recorded as skipped with its reason, never fatal.

Rows {"impl": "nsa"|"nsa-fixed"|"flex", "mod", "T", "HQ", "H", "pass": "fwd"|"fwd+bwd", "ms",
"tflops", "gpu"} go to <out>/<date>-<gpu>-flex.json with a meta file. "nsa-fixed" is nsa's own
attention op with the mod's fixed options (causal, window, softcap; documents as varlen
sequences), where the mod is one: nsa.flex_attention takes that path itself for such mods (the
dense route, docs/spec.md 14), so its rows there should read as nsa-fixed's.

  python3 bench/flex.py --out bench/results
  python3 bench/flex.py --self-test                    # the pair counts and the table, no GPU
  python3 bench/flex.py --device cpu --T 512 --impl nsa --mods causal,alibi --reps 1
  python3 bench/flex.py --first-call --T 16k --heads 16/16 --mods alibi,relbias  # compile / cached load
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
import peers as harness  # noqa: E402  (device_description, gpu_slug, parse_T, fmt_T, write_json)

D = 128
WINDOW, PREFIX, DOC = 1024, 2048, 4096
MODS = ("causal", "window", "prefix", "document", "alibi", "softcap", "relbias")
IMPLS = ("nsa", "nsa-fixed", "flex")
FIXED = ("causal", "window", "document", "softcap")  # the mods nsa.attention's options express


def fixed_options(mod, T):
    """nsa.attention's options for a mod that has them (B = 1; documents of DOC tokens as varlen)."""
    if mod == "causal":
        return dict(causal=True)
    if mod == "window":  # q - k < WINDOW and k <= q
        return dict(causal=True, window=(WINDOW - 1, -1))
    if mod == "softcap":
        return dict(causal=True, softcap=30.0)
    if mod == "document":
        return dict(causal=True, cu_seqlens=list(range(0, T, DOC)) + [T])
    raise ValueError(mod)


def visible_pairs(mod, T):
    """Visible (query, key) pairs of one head at length T, in closed form."""
    causal = T * (T + 1) // 2
    if mod in ("causal", "alibi", "softcap", "relbias"):
        return causal
    if mod == "window":  # q - k < WINDOW and k <= q
        w = min(WINDOW, T)
        return w * (w + 1) // 2 + (T - w) * w
    if mod == "prefix":  # k < PREFIX or k <= q
        p = min(PREFIX, T)
        return causal + sum(max(0, min(p, T) - (i + 1)) for i in range(p))
    if mod == "document":  # causal inside documents of DOC tokens
        full, rest = divmod(T, DOC)
        return full * DOC * (DOC + 1) // 2 + rest * (rest + 1) // 2
    raise ValueError(mod)


def flops(mod, T, HQ, pass_name, B=1):
    f = 4.0 * D * visible_pairs(mod, T) * HQ * B
    return f * (2.5 if pass_name == "fwd+bwd" else 1.0)


def make_row(impl, mod, T, HQ, H, pass_name, ms, gpu):
    return {"impl": impl, "mod": mod, "T": T, "HQ": HQ, "H": H, "pass": pass_name, "ms": round(ms, 4),
            "tflops": round(flops(mod, T, HQ, pass_name) / (ms * 1e-3) / 1e12, 2), "gpu": gpu}


def format_table(rows, skipped=()):
    lines = ["%-9s %-9s %6s %7s %-8s %10s %8s %10s" % ("impl", "mod", "T", "HQ/H", "pass", "ms", "TFLOP/s", "/ flex")]
    ref = {(r["mod"], r["T"], r["HQ"], r["pass"]): r["ms"] for r in rows if r["impl"] == "flex"}
    for r in sorted(rows, key=lambda r: (MODS.index(r["mod"]), r["T"], -r["HQ"], r["pass"], IMPLS.index(r["impl"]))):
        peer = ref.get((r["mod"], r["T"], r["HQ"], r["pass"]))
        ratio = "%.3f" % (r["ms"] / peer) if r["impl"] != "flex" and peer else ""
        lines.append("%-9s %-9s %6s %7s %-8s %10.3f %8.1f %10s" % (r["impl"], r["mod"], harness.fmt_T(r["T"]),
                                                                   "%d/%d" % (r["HQ"], r["H"]), r["pass"], r["ms"],
                                                                   r["tflops"], ratio))
    for s in skipped:
        lines.append("skipped: %s" % s)
    lines.append("TFLOP/s: visible pairs only (4 D flops each forward, 2.5x for fwd+bwd); / flex < 1: faster than "
                 "FlexAttention")
    return "\n".join(lines)


def self_test():
    fails = 0

    def check(cond, what):
        nonlocal fails
        print("%s %s" % ("ok  " if cond else "FAIL", what))
        fails += not cond

    def brute(mod, T):
        n = 0
        for i in range(T):
            for j in range(T):
                if mod == "window":
                    n += j <= i and i - j < WINDOW
                elif mod == "prefix":
                    n += j < PREFIX or j <= i
                elif mod == "document":
                    n += j <= i and i // DOC == j // DOC
                else:
                    n += j <= i
        return n

    global WINDOW, PREFIX, DOC
    keep = (WINDOW, PREFIX, DOC)
    WINDOW, PREFIX, DOC = 5, 7, 9  # small, so the brute force is quick
    for mod in MODS:
        for T in (1, 8, 23, 40):
            check(visible_pairs(mod, T) == brute(mod, T), "%s pairs at T=%d" % (mod, T))
    WINDOW, PREFIX, DOC = keep
    r = make_row("nsa", "causal", 16384, 16, 16, "fwd", 2.0, "H100")
    check(abs(r["tflops"] - flops("causal", 16384, 16, "fwd") / 2e-3 / 1e12) < 0.01, "row TFLOP/s")
    t = format_table([r, make_row("flex", "causal", 16384, 16, 16, "fwd", 2.5, "H100")], ["nsa fwd+bwd: no CUDA backward"])
    check("0.800" in t and "skipped: nsa" in t, "table ratio and skips")
    check(json.loads(json.dumps([r]))[0] == r, "JSON round trip")
    check(fixed_options("window", 100)["window"] == (WINDOW - 1, -1) and
          fixed_options("document", 2 * DOC + 5)["cu_seqlens"] == [0, DOC, 2 * DOC, 2 * DOC + 5], "fixed options")
    total = 4 * 4 * len(MODS) + 4
    print("%d passed, %d failed" % (total - fails, fails))
    return 1 if fails else 0


# ---- the mods, for both implementations ------------------------------------------------------------

def mods_for(name, T, torch, device, HQ):
    """(mask_mod, score_mod) as Python callables over torch tensors on device (both libraries
    trace the same functions)."""
    doc = (torch.arange(T, device=device) // DOC).to(torch.int32)
    slope = torch.tensor([2.0 ** (-8.0 * (h + 1) / HQ) for h in range(HQ)], device=device)
    rel = torch.linspace(-1.0, 1.0, 2 * 4096 + 1, device=device)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    def prefix(b, h, q_idx, kv_idx):
        return (kv_idx < PREFIX) | (q_idx >= kv_idx)

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slope[h] * torch.abs(q_idx - kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def relbias(score, b, h, q_idx, kv_idx):
        return score + rel[torch.clamp(q_idx - kv_idx, -4096, 4096) + 4096]

    return {"causal": (causal, None), "window": (window, None), "prefix": (prefix, None), "document": (document, None),
            "alibi": (causal, alibi), "softcap": (causal, softcap), "relbias": (causal, relbias)}[name]


class Bench:
    def __init__(self, torch, args, device):
        self.torch, self.args, self.dev = torch, args, device
        self.time_ms = harness.Timer(torch, device, args.reps, args.warmup).ms

    def closure(self, impl, mod, T, HQ, H, pass_name):
        torch = self.torch
        dt = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        grad = pass_name == "fwd+bwd"
        q = torch.randn(1, HQ, T, D, device=self.dev, dtype=dt, requires_grad=grad)
        k = torch.randn(1, H, T, D, device=self.dev, dtype=dt, requires_grad=grad)
        v = torch.randn(1, H, T, D, device=self.dev, dtype=dt, requires_grad=grad)
        mask_mod, score_mod = mods_for(mod, T, torch, self.dev, HQ)
        if impl == "nsa":
            import nsa
            import nsa.flex
            bm = nsa.create_block_mask(mask_mod, None, None, T, T, device=self.dev, BLOCK_SIZE=128)
            sm = nsa.flex.Mod(score_mod, "score_mod") if score_mod else None

            def run():
                o = nsa.flex_attention(q, k, v, score_mod=sm, block_mask=bm, enable_gqa=H != HQ)
                if grad:
                    o.backward(torch.ones_like(o))
        elif impl == "nsa-fixed":
            import nsa
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, T, H, D] views of the same tensors
            opts = fixed_options(mod, T)

            def run():
                o = nsa.attention(qt, kt, vt, **opts).o
                if grad:
                    o.backward(torch.ones_like(o))
        else:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            harness.raise_compile_limits(torch)  # (a compile per mod, T and pass)
            bm = create_block_mask(mask_mod, None, None, T, T, device=self.dev)
            compiled = torch.compile(flex_attention, dynamic=False)

            def run():
                o = compiled(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=H != HQ)
                if grad:
                    o.backward(torch.ones_like(o))
        return run


def run(args):
    import torch
    device = torch.device(args.device)
    info, name, gpu = harness.device_description(torch, device)
    print("gpu: %s" % gpu, flush=True)
    bench = Bench(torch, args, device)
    rows, skipped = [], []
    for mod in args.mods:
        for T in args.T:
            for HQ, H in args.heads:
                for pass_name in args.passes:
                    for impl in args.impl:
                        if impl == "nsa-fixed" and mod not in FIXED:
                            continue  # (no fixed option expresses the mod)
                        what = "%s %s T=%s %d/%d %s" % (impl, mod, harness.fmt_T(T), HQ, H, pass_name)
                        try:
                            fn = bench.closure(impl, mod, T, HQ, H, pass_name)
                            ms = bench.time_ms(fn)
                        except Exception as e:
                            skipped.append("%s: %s: %s" % (what, type(e).__name__, (str(e).splitlines() or [""])[0][:160]))
                            if args.verbose:
                                traceback.print_exc()
                            continue
                        rows.append(make_row(impl, mod, T, HQ, H, pass_name, ms, name))
                        print("  %-40s %10.3f ms" % (what, ms), flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    print()
    print(format_table(rows, skipped))
    if args.out:
        stem = harness.write_results(args.out, name, "flex", rows, {
            "gpu": gpu, "nvidia_smi": info, "skipped": skipped, "argv": harness.record_argv(sys.argv, args.out),
            "torch": torch.__version__,
            "timing": "CUDA events, L2 flushed (256 MB zeroed), median of %d runs after %d warm-up runs" % (args.reps,
                                                                                                        args.warmup)})
        print("wrote %s.json and %s.meta.json" % (stem, stem))
    return 0


# ---- the first call of a new mod: compile (a fresh kernel cache) and load (the disk cache) ---------

def first_call_child(args):
    """One process's first nsa.flex_attention forward, then its first backward, on a mod (args.mods[0]),
    each timed to completion; prints one JSON line {"fwd_ms", "bwd_ms"}."""
    import time
    import torch
    import nsa
    import nsa.flex
    dev = torch.device(args.device)
    T, (HQ, H), mod = args.T[0], args.heads[0], args.mods[0]
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q = torch.randn(1, HQ, T, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, H, T, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, H, T, D, device=dev, dtype=dt, requires_grad=True)
    mask_mod, score_mod = mods_for(mod, T, torch, dev, HQ)
    bm = nsa.create_block_mask(mask_mod, None, None, T, T, device=dev, BLOCK_SIZE=128)
    sm = nsa.flex.Mod(score_mod, "score_mod") if score_mod else None
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    # the library, its context and torch's op machinery warmed up on a call that compiles nothing
    # (no mods: the dense route), so the times below are the mod's own
    w = torch.randn(1, 1, 16, D, device=dev, dtype=dt, requires_grad=True)
    nsa.flex_attention(w, w, w).sum().backward()
    sync()
    t0 = time.perf_counter()
    o = nsa.flex_attention(q, k, v, score_mod=sm, block_mask=bm, enable_gqa=H != HQ)
    sync()
    t1 = time.perf_counter()
    o.backward(torch.ones_like(o))
    sync()
    t2 = time.perf_counter()
    print(json.dumps({"fwd_ms": (t1 - t0) * 1e3, "bwd_ms": (t2 - t1) * 1e3}))
    return 0


def first_calls(args):
    """Per mod, two processes in turn sharing one fresh NSA_CACHE_DIR: the first compiles the
    mod's kernels (cold), the second loads them from the disk cache. (NVRTC may keep a cache of
    its own across processes, which only a fresh machine's first run avoids.)"""
    import subprocess
    import tempfile
    rows = []
    T, (HQ, H) = args.T[0], args.heads[0]
    for mod in args.mods:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, NSA_CACHE_DIR=cache, PYTHONPATH=os.path.join(REPO, "python"))
            for kind in ("cold", "disk"):
                cmd = [sys.executable, os.path.abspath(__file__), "--first-call-child", "--mods", mod, "--T", str(T),
                       "--heads", "%d/%d" % (HQ, H), "--device", args.device]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                line = (out.stdout.strip().splitlines() or [""])[-1]
                if out.returncode != 0 or not line.startswith("{"):
                    print("  %s %s: failed: %s" % (mod, kind, (out.stderr.strip().splitlines() or ["?"])[-1][:200]))
                    continue
                got = json.loads(line)
                rows.append({"mod": mod, "cache": kind, "T": T, "HQ": HQ, "H": H, "fwd_ms": round(got["fwd_ms"], 2),
                             "bwd_ms": round(got["bwd_ms"], 2)})
                print("  %-9s %-5s first forward %9.2f ms, first backward %9.2f ms" % (mod, kind, got["fwd_ms"],
                                                                                       got["bwd_ms"]), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", default="4k,16k,64k")
    ap.add_argument("--heads", default="16/16,64/4", help="HQ/H pairs, comma-separated")
    ap.add_argument("--mods", default=",".join(MODS))
    ap.add_argument("--impl", default=",".join(IMPLS))
    ap.add_argument("--passes", default="fwd,fwd+bwd")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--first-call", action="store_true",
                    help="time each mod's first forward and backward in a fresh process, compiling (a fresh kernel "
                         "cache) and then loading from the disk cache (the first --T and --heads)")
    ap.add_argument("--first-call-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    args.T = harness.parse_T(args.T)
    args.heads = [tuple(int(x) for x in hh.split("/")) for hh in args.heads.split(",") if hh]
    args.mods = [m for m in args.mods.split(",") if m]
    args.impl = [i for i in args.impl.split(",") if i]
    args.passes = [p for p in args.passes.split(",") if p]
    bad = [m for m in args.mods if m not in MODS] + [i for i in args.impl if i not in IMPLS]
    if bad:
        ap.error("unknown mod or impl: %s" % ", ".join(bad))
    if args.first_call_child:
        return first_call_child(args)
    if args.first_call:
        rows = first_calls(args)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, "flex-first-call.json")
            with open(path, "w") as f:
                json.dump(rows, f, indent=1)
            print("wrote %s" % path)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
