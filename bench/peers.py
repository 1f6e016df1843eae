#!/usr/bin/env python3
"""bench/peers.py -- nsa against the public NSA kernels and dense/windowed attention, one process.

Times, on one GPU, bf16, B = 1, D = 128, forward and forward+backward:

  nsa     this library through torch: nsa.native_sparse_attention (paper and fla configs) and
          nsa.parallel_nsa (fla's signature, fla config, no window)
  fla     fla.ops.nsa.parallel_nsa (fla-org/flash-linear-attention), fla config, no window
          (its window branch needs flash-attn, which the harness does not assume)
  mdy666  flash_nsa.HFNSACore (mdy666/Scalable-Flash-Native-Sparse-Attention), paper config; its
          window branch (flash-attn) replaced by a compiled FlexAttention sliding window
  cudnn   torch SDPA, dense causal, cuDNN backend
  fa2     torch SDPA, dense causal, flash backend (FlashAttention-2 kernels)
  flex    torch FlexAttention, causal sliding window of 512 keys, GQA, compiled

Peers come from $NSA_PEERS (default <repo>/peers, git-ignored; scripts/fetch-peers.sh fills it);
an absent peer is skipped with the reason printed. bench/PEERS.md says how to run it, what each
row means and the caveats.

  python3 bench/peers.py --T 8k,16k,32k,64k,128k --G 16,4 --out DIR
  python3 bench/peers.py --workload layer.npz   # nsa and mdy666 on one saved layer's inputs
  python3 bench/peers.py --list            # the plan and the FLOP counts, no torch needed
  python3 bench/peers.py --self-test       # the pure functions, no torch needed

Timing: CUDA events around each run after warm-up runs, a 256 MB buffer zeroed before each run to
flush the L2 (as triton.testing.do_bench), median of --reps runs (fewer when one run is long:
--max-seconds per measurement). Inputs torch.randn (gates torch.rand), or with --workload those an
attention layer of a trained model fed its NSA call (bench/workload.py's .npz: q, k, v, the gates,
the layer's learned compressed keys and values, its NSA configuration): nsa takes all of them;
mdy666 takes q, k, v and the gates (as its combine weights, their logits) with its own compression
and the layer's configuration, so its selection is its own. An out-of-memory or any
other failure of one (impl, G, T) is recorded as skipped, never fatal; after an out-of-memory the
larger T of that implementation are skipped too.

Output: one table (ms, TFLOP/s, nsa ms / peer ms), <out>/<date>-<gpu>.json (a list of measured
rows), <out>/<date>-<gpu>.meta.json (GPU, driver, clocks, versions, peer commits, skipped rows)
and <out>/<date>-<gpu>.png (log-log time against T; needs matplotlib).
"""
import argparse
import datetime
import gc
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

IMPLS = ("nsa", "fla", "mdy666", "cudnn", "fa2", "flex")
PASSES = ("fwd", "fwd+bwd")
# NSA configurations (nsa.Config field names, python/nsa/_core.py). n_init = 1, n_local = 2 in both.
CONFIGS = {
    "paper": dict(cmp_len=32, cmp_stride=16, slc_block=64, slc_topk=16, window=512),
    "fla": dict(cmp_len=64, cmp_stride=64, slc_block=64, slc_topk=16, window=512),
}
WINDOW = 512  # the flex row's window and nsa's w: query t sees keys t-511 .. t
BWD_FACTOR = 2.5  # backward FLOPs / forward FLOPs (the FlashAttention-2 count, as tools/nsa_cli.c)

# One measurement: (impl, variant, config, window branch on?). The nsa row a peer is compared to
# is REFERENCE[(impl, variant)] = (nsa variant, config).
PLAN = [
    ("nsa", "native", "paper", True),        # nsa.native_sparse_attention, paper config, 3 branches
    ("nsa", "native-noswa", "paper", False),  # same, g_swa=None: only when mdy666 runs without window
    ("nsa", "native", "fla", False),          # fla config through nsa.Config, g_swa=None
    ("nsa", "parallel_nsa", "fla", False),    # nsa.parallel_nsa(..., window_size=0)
    ("fla", "parallel_nsa", "fla", False),
    ("mdy666", "hf+flexswa", "paper", True),  # HFNSACore, window through FlexAttention
    ("mdy666", "hf-noswa", "paper", False),   # fallback when FlexAttention fails: window branch = 0
    ("nsa", "attention", "dense", False),     # nsa.attention(causal=True): the library's flash-attention core
    ("nsa", "attention", "swa", True),        # nsa.attention(causal=True, window=(511, 0)): NSA's window branch
    ("cudnn", "sdpa", "dense", False),
    ("fa2", "sdpa", "dense", False),
    ("flex", "flex", "swa", True),
]
# --workload: the rows of one saved layer (config "workload": the layer's, B = 1, its T and heads)
WORKLOAD_PLAN = [
    ("nsa", "native", "workload", True),
    ("nsa", "native-noswa", "workload", False),
    ("mdy666", "hf+flexswa", "workload", True),
    ("mdy666", "hf-noswa", "workload", False),
]
REFERENCE = {
    ("nsa", "parallel_nsa"): ("native", "fla"),
    ("fla", "parallel_nsa"): ("native", "fla"),
    ("mdy666", "hf+flexswa"): ("native", "paper"),
    ("mdy666", "hf-noswa"): ("native-noswa", "paper"),
    # dense and windowed attention against the same computation in nsa (nsa.attention); the NSA rows
    # against dense attention are read off the ms columns
    ("cudnn", "sdpa"): ("attention", "dense"),
    ("fa2", "sdpa"): ("attention", "dense"),
    ("flex", "flex"): ("attention", "swa"),
}


# ==== pure functions: FLOP counts, rows, table, files (no torch) =================================


def cmp_visible(t, cmp_len, cmp_stride):
    """Compressed blocks query t sees: block i iff i*d + l - 1 <= t (spec 2; tools/nsa_cli.c)."""
    return (t + 1 - cmp_len) // cmp_stride + 1 if t + 1 >= cmp_len else 0


def slc_visible(t, slc_block, slc_topk):
    """Keys of the selected blocks query t reads, assuming a full selection: the current block
    (t % l' + 1 keys, always selected) and n - 1 earlier full blocks, or all t + 1 keys when
    there are at most n blocks so far."""
    return min(t + 1, (slc_topk - 1) * slc_block + t % slc_block + 1)


_PAIRS = {}


def nsa_pairs(T, cfg):
    """(cmp, slc, swa): (query, key) pairs each branch scores, summed over queries 0..T-1, per
    query head (the FLOP basis of tools/nsa_cli.c's count_work, with slc_visible for the
    selection that the CLI reads from the computed block indices)."""
    key = (T, tuple(sorted(cfg.items())))
    if key not in _PAIRS:
        cmp = slc = swa = 0
        l, d, lp, n, w = cfg["cmp_len"], cfg["cmp_stride"], cfg["slc_block"], cfg["slc_topk"], cfg["window"]
        for t in range(T):
            cmp += cmp_visible(t, l, d)
            slc += slc_visible(t, lp, n)
            swa += min(t + 1, w)
        _PAIRS[key] = (cmp, slc, swa)
    return _PAIRS[key]


def pass_factor(pass_name):
    """FLOPs of the pass / forward FLOPs: 1 forward, 1 + 2.5 forward+backward."""
    if pass_name not in PASSES:
        raise ValueError("pass must be one of %s, not %r" % (PASSES, pass_name))
    return 1.0 if pass_name == "fwd" else 1.0 + BWD_FACTOR


def nsa_flops(T, HQ, H, D, cfg, window, pass_name, B=1):
    """NSA FLOPs as tools/nsa_cli.c counts nsa_forward (+ nsa_backward): 4*D per (query head,
    key) pair of the compressed, selected and (if on) window branches (2.5x backward), plus
    the compression (l adds per output element, once forward and once backward) and the gating
    (5 per output element forward, 10 backward). Importance scores / top-n are not counted."""
    cmp, slc, swa = nsa_pairs(T, cfg)
    pairs = (cmp + slc + (swa if window else 0)) * HQ * B
    fa = 4.0 * D
    nc = (T - cfg["cmp_len"]) // cfg["cmp_stride"] + 1 if T >= cfg["cmp_len"] else 0
    compress = float(B * nc * H * 2 * D * cfg["cmp_len"])
    gate = 5.0 * B * T * HQ * D
    fwd = compress + pairs * fa + gate
    if pass_name == "fwd":
        return fwd
    pass_factor(pass_name)
    return fwd + compress + BWD_FACTOR * pairs * fa + 2.0 * gate


def dense_flops(T, HQ, D, pass_name, B=1):
    """Dense causal attention: 4*T*T/2*D*HQ forward (T^2/2 visible pairs, QK^T and PV), 2.5x that
    backward."""
    return 4.0 * T * T / 2.0 * D * HQ * B * pass_factor(pass_name)


def swa_flops(T, HQ, D, window, pass_name, B=1):
    """Causal sliding window: 4*D per visible pair, min(t + 1, window) keys for query t."""
    pairs = sum(min(t + 1, window) for t in range(T)) if T <= window else \
        window * (window + 1) // 2 + (T - window) * window
    return 4.0 * D * pairs * HQ * B * pass_factor(pass_name)


WORKLOAD_ARRAYS = ("q", "k", "v", "g_cmp", "g_slc", "g_swa", "k_cmp", "v_cmp")


def workload_shape(shapes, config):
    """(T, HQ, H, D, nsa configuration) of a saved layer from its arrays' shapes (name -> shape:
    q [1, T, HQ, D]; k, v [1, T, H, D]; the gates [1, T, HQ]; k_cmp, v_cmp [1, Nc, H, D]) and
    its 7 configuration values (cmp_len, cmp_stride, slc_block, slc_topk, n_init, n_local, window,
    as bench/workload.py writes them). ValueError naming the first array or value that is off."""
    shapes = {n: tuple(int(x) for x in shapes[n]) for n in WORKLOAD_ARRAYS if n in shapes}
    missing = [n for n in WORKLOAD_ARRAYS if n not in shapes]
    if missing:
        raise ValueError("workload: lacks %s (bench/workload.py writes them)" % ", ".join(missing))
    q_shape, k_shape = shapes["q"], shapes["k"]
    if len(q_shape) != 4 or len(k_shape) != 4 or q_shape[0] != 1 or k_shape[:2] != q_shape[:2] or k_shape[3] != q_shape[3]:
        raise ValueError("workload: q must be [1, T, HQ, D] and k [1, T, H, D], got %s and %s" % (q_shape, k_shape))
    _, T, HQ, D = q_shape
    H = k_shape[2]
    if H < 1 or HQ % H:
        raise ValueError("workload: HQ %d is not a multiple of H %d" % (HQ, H))
    want = {"v": (1, T, H, D), "g_cmp": (1, T, HQ), "g_slc": (1, T, HQ), "g_swa": (1, T, HQ)}
    for n, w in want.items():
        if shapes[n] != w:
            raise ValueError("workload: %s must be %s, got %s" % (n, list(w), list(shapes[n])))
    for n in ("k_cmp", "v_cmp"):
        s = shapes[n]
        if len(s) != 4 or s[0] != 1 or s[2] != H or s[3] != D or s[1] != shapes["k_cmp"][1]:
            raise ValueError("workload: %s must be [1, Nc, %d, %d] (as k_cmp), got %s" % (n, H, D, list(s)))
    vals = [int(x) for x in config]
    if len(vals) != 7 or min(vals[:4]) < 1 or min(vals[4:6]) < 0 or vals[6] < 1:
        raise ValueError("workload: config must be 7 values (cmp_len, cmp_stride, slc_block, slc_topk, n_init, n_local, "
                         "window), got %s" % (vals,))
    keys = ("cmp_len", "cmp_stride", "slc_block", "slc_topk", "n_init", "n_local", "window")
    return T, HQ, H, D, dict(zip(keys, vals))


def row_flops(impl, config, window, T, HQ, H, D, pass_name):
    if config == "dense":
        return dense_flops(T, HQ, D, pass_name)
    if config == "swa":
        return swa_flops(T, HQ, D, WINDOW, pass_name)
    return nsa_flops(T, HQ, H, D, CONFIGS[config], window, pass_name)


def make_row(impl, variant, config, G, T, pass_name, ms, gpu, HQ, H, D, window, runs=None, note=None):
    """One JSON row: the keys of the brief (impl, config, G, T, pass, ms, tflops, gpu) plus
    variant, HQ, H, D, runs, note."""
    if impl not in IMPLS:
        raise ValueError("impl %r not in %s" % (impl, IMPLS))
    if config not in ("paper", "fla", "dense", "swa", "workload"):
        raise ValueError("config %r" % (config,))
    ms = float(ms)
    flops = row_flops(impl, config, window, T, HQ, H, D, pass_name)
    row = {"impl": impl, "config": config, "G": int(G), "T": int(T), "pass": pass_name, "ms": round(ms, 4),
           "tflops": round(flops / ms / 1e9, 2) if ms > 0 else None, "gpu": gpu,
           "variant": variant, "HQ": int(HQ), "H": int(H), "D": int(D), "window": bool(window)}
    if runs is not None:
        row["runs"] = int(runs)
    if note:
        row["note"] = note
    return row


def find_reference(rows, row):
    """The nsa row a peer row is compared with (same G, T, pass; REFERENCE's variant and config)."""
    ref = REFERENCE.get((row["impl"], row["variant"]))
    if ref is None:
        return None
    if row["config"] == "workload":  # a saved layer's rows compare among themselves
        ref = (ref[0], "workload")
    for r in rows:
        if (r["impl"] == "nsa" and r["variant"] == ref[0] and r["config"] == ref[1] and r["G"] == row["G"]
                and r["T"] == row["T"] and r["pass"] == row["pass"]):
            return r
    return None


def ratio(rows, row):
    """nsa ms / peer ms (below 1: nsa faster), or None without an nsa row to compare."""
    ref = find_reference(rows, row)
    if ref is None or not row["ms"]:
        return None
    return ref["ms"] / row["ms"]


def fmt_T(T):
    return "%dk" % (T // 1024) if T % 1024 == 0 else str(T)


def parse_T(text):
    """'8k,16k,32768' -> [8192, 16384, 32768]."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1048576 if part.endswith("m") else 1
        out.append(int(part.rstrip("km")) * mult)
    return out


def _order(row):
    plan = [(p[0], p[1], p[2]) for p in PLAN]
    key = (row["impl"], row["variant"], row["config"])
    return (-row["G"], PASSES.index(row["pass"]), plan.index(key) if key in plan else 99, row["T"])


def format_table(rows, skipped=()):
    """The printed table: one line per measured row, grouped by G and pass, with nsa/peer."""
    lines = []
    head = "%-7s %-13s %-8s %3s %6s %-8s %10s %9s %9s  %s" % (
        "impl", "variant", "config", "G", "T", "pass", "ms", "TFLOP/s", "nsa/peer", "compared with")
    lines.append(head)
    lines.append("-" * len(head))
    last = None
    for row in sorted(rows, key=_order):
        group = (row["G"], row["pass"])
        if last is not None and group != last:
            lines.append("")
        last = group
        r = ratio(rows, row)
        ref = REFERENCE.get((row["impl"], row["variant"]))
        lines.append("%-7s %-13s %-8s %3d %6s %-8s %10.3f %9s %9s  %s" % (
            row["impl"], row["variant"], row["config"], row["G"], fmt_T(row["T"]), row["pass"], row["ms"],
            "-" if row.get("tflops") is None else "%.1f" % row["tflops"],
            "-" if r is None else "%.3f" % r,
            "" if ref is None else "nsa %s/%s" % (ref[1], ref[0])))
    if skipped:
        lines.append("")
        lines.append("skipped:")
        for s in skipped:
            lines.append("  %-7s %-13s %-8s G=%-3s T=%-6s %-8s %s" % (
                s["impl"], s.get("variant", ""), s.get("config", ""), s.get("G", ""),
                fmt_T(s["T"]) if isinstance(s.get("T"), int) else s.get("T", ""), s.get("pass", ""), s["reason"]))
    lines.append("nsa/peer = nsa ms / peer ms (< 1: nsa faster); TFLOP/s: NSA visible pairs (bench/PEERS.md), "
                 "dense causal T^2/2 pairs, 2.5x backward")
    return "\n".join(lines)


def gpu_slug(name):
    """'NVIDIA H100 80GB HBM3' -> 'h100'; else a lower-case slug of the name."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", name or "")
    if m:
        return m.group(1).lower()
    slug = re.sub(r"[^a-z0-9]+", "-", (name or "gpu").lower()).strip("-")
    return slug or "gpu"


def result_stem(out_dir, date, gpu_name, tag=None):
    return os.path.join(out_dir, "%s-%s%s" % (date, gpu_slug(gpu_name), "-" + tag if tag else ""))


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def write_results(out_dir, gpu_name, tag, rows, meta):
    """A benchmark's results: <out_dir>/<today>-<gpu>-<tag>.json (the rows) and .meta.json beside
    it (the folder made if absent). Returns the path without its extension."""
    os.makedirs(out_dir, exist_ok=True)
    stem = result_stem(out_dir, datetime.date.today().isoformat(), gpu_name, tag)
    write_json(stem + ".json", rows)
    write_json(stem + ".meta.json", meta)
    return stem


def write_png(path, rows, title=""):
    """Log-log time against T, one panel per (G, pass), one line per (impl, variant, config).
    Returns None when written, else the reason it was not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return "matplotlib not available (%s): no PNG" % e
    if not rows:
        return "no rows: no PNG"
    Gs = sorted({r["G"] for r in rows}, reverse=True)
    keys = sorted({(r["impl"], r["variant"], r["config"]) for r in rows}, key=lambda k: (IMPLS.index(k[0]), k))
    colors = {k: "C%d" % (i % 10) for i, k in enumerate(keys)}  # one colour per line in every panel
    Ts = sorted({r["T"] for r in rows})
    fig, axes = plt.subplots(len(Gs), 2, figsize=(13, 4.8 * len(Gs)), squeeze=False)
    for i, G in enumerate(Gs):
        for j, p in enumerate(PASSES):
            ax = axes[i][j]
            series = {}
            for r in rows:
                if r["G"] == G and r["pass"] == p:
                    series.setdefault((r["impl"], r["variant"], r["config"]), []).append((r["T"], r["ms"]))
            for (impl, variant, config), pts in sorted(series.items(), key=lambda kv: IMPLS.index(kv[0][0])):
                pts.sort()
                style = "-" if impl == "nsa" else "--"
                ax.plot([t for t, _ in pts], [m for _, m in pts], style, marker="o",
                        color=colors[(impl, variant, config)], label="%s %s (%s)" % (impl, variant, config))
            ax.set_xscale("log", base=2)
            ax.set_xlim(Ts[0] / 1.25, Ts[-1] * 1.25)
            ax.set_xticks(Ts)
            ax.set_xticklabels([fmt_T(t) for t in Ts])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("T (tokens)")
            ax.set_ylabel("ms")
            ax.set_title("G = %d (HQ = %d), %s" % (G, rows[0]["H"] * G, p))
            ax.grid(True, which="both", alpha=0.3)
            if series:
                ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def plan_rows(impls, Gs, Ts, passes, H=4, plan=None):
    """The (impl, variant, config, window, G, T, pass) measurements for the given selection,
    before availability is known (native-noswa and hf-noswa are added only at run time)."""
    out = []
    for G in Gs:
        for T in Ts:
            for impl, variant, config, window in (PLAN if plan is None else plan):
                if impl not in impls or variant in ("native-noswa", "hf-noswa"):
                    continue
                for p in passes:
                    out.append((impl, variant, config, window, G, T, p))
    return out


def peer_commit(peers_dir, name):
    try:
        with open(os.path.join(peers_dir, name, "PEER_COMMIT")) as f:
            return f.read().strip()
    except OSError:
        return None


def self_test():
    """Checks of the pure functions (run here, without torch)."""
    fails = []
    count = [0]

    def check(cond, what):
        count[0] += 1
        if not cond:
            fails.append(what)

    # compressed blocks: paper l=32 d=16: t=30 none, t=31 one, t=47 two
    check(cmp_visible(30, 32, 16) == 0 and cmp_visible(31, 32, 16) == 1 and cmp_visible(47, 32, 16) == 2, "cmp_visible")
    check(slc_visible(100, 64, 16) == 101 and slc_visible(16 * 64, 64, 16) == 15 * 64 + 1, "slc_visible")
    # brute force of nsa_pairs on a small T against the definitions
    cfg = CONFIGS["paper"]
    T = 3000
    bc = sum(sum(1 for i in range(T) if i * 16 + 31 <= t) for t in range(T))
    bw = sum(len(range(max(0, t - 511), t + 1)) for t in range(T))
    bs = 0
    for t in range(T):
        blocks = list(range(t // 64 + 1))[-16:]  # the current and the 15 before: any 16 cost the same
        bs += sum(min(64, t + 1 - b * 64) for b in blocks)
    check(nsa_pairs(T, cfg) == (bc, bs, bw), "nsa_pairs %s != %s" % (nsa_pairs(T, cfg), (bc, bs, bw)))
    # dense causal: 4*T*T/2*D*HQ forward; 3.5x for forward+backward
    check(dense_flops(8192, 64, 128, "fwd") == 2.0 * 8192 ** 2 * 128 * 64, "dense fwd")
    check(abs(dense_flops(8192, 64, 128, "fwd+bwd") / dense_flops(8192, 64, 128, "fwd") - 3.5) < 1e-12, "dense bwd")
    check(swa_flops(2000, 1, 1, 512, "fwd") == 4.0 * sum(min(t + 1, 512) for t in range(2000)), "swa closed form")
    check(swa_flops(300, 1, 1, 512, "fwd") == 4.0 * 300 * 301 / 2, "swa short")
    # paper config at 64k, HQ=64, D=128: the performance targets' ~7.7 TFLOP forward (cmp ~4.4, slc ~2.2, window ~1.1)
    f64 = nsa_flops(65536, 64, 4, 128, cfg, True, "fwd") / 1e12
    check(7.0 < f64 < 8.5, "paper 64k forward %.2f TFLOP, the performance targets say ~7.7" % f64)
    cmp, slc, swa = nsa_pairs(65536, cfg)
    check(abs(cmp * 64 * 512 / 1e12 - 4.4) < 0.2 and abs(slc * 64 * 512 / 1e12 - 2.2) < 0.2
          and abs(swa * 64 * 512 / 1e12 - 1.1) < 0.1, "branch split at 64k")
    check(nsa_flops(8192, 64, 4, 128, CONFIGS["fla"], False, "fwd") < nsa_flops(8192, 64, 4, 128, CONFIGS["fla"], True, "fwd"),
          "window adds FLOPs")
    try:
        pass_factor("bwd")
        check(False, "pass 'bwd' accepted")
    except ValueError:
        pass
    check(parse_T("8k,16k, 32768,1m") == [8192, 16384, 32768, 1048576], "parse_T")
    check(fmt_T(131072) == "128k" and fmt_T(1000) == "1000", "fmt_T")
    check(gpu_slug("NVIDIA H100 80GB HBM3") == "h100" and gpu_slug("NVIDIA H200") == "h200"
          and gpu_slug("NVIDIA A100-SXM4-80GB") == "a100" and gpu_slug("Weird GPU") == "weird-gpu", "gpu_slug")
    # rows, ratios, table
    gpu = "NVIDIA H100 80GB HBM3, driver 580.159.04, sm 1980/1980 MHz, mem 2619/2619 MHz"
    rows = []
    for T, base in ((8192, 3.0), (16384, 7.0), (32768, 16.0)):
        for p, k in (("fwd", 1.0), ("fwd+bwd", 3.2)):
            rows.append(make_row("nsa", "native", "paper", 16, T, p, base * k, gpu, 64, 4, 128, True, runs=10))
            rows.append(make_row("nsa", "native", "fla", 16, T, p, base * k * 0.8, gpu, 64, 4, 128, False))
            rows.append(make_row("fla", "parallel_nsa", "fla", 16, T, p, base * k * 1.6, gpu, 64, 4, 128, False))
            rows.append(make_row("mdy666", "hf+flexswa", "paper", 16, T, p, base * k * 0.5, gpu, 64, 4, 128, True))
            rows.append(make_row("nsa", "attention", "dense", 16, T, p, (T / 8192) ** 2 * 2.85 * k, gpu, 64, 4, 128,
                                 False))
            rows.append(make_row("cudnn", "sdpa", "dense", 16, T, p, (T / 8192) ** 2 * 1.9 * k, gpu, 64, 4, 128, False))
            rows.append(make_row("flex", "flex", "swa", 16, T, p, T / 8192 * 0.6 * k, gpu, 64, 4, 128, True))
    rows.append(make_row("mdy666", "hf+flexswa", "paper", 4, 8192, "fwd", 1.0, gpu, 16, 4, 128, True))
    r = [x for x in rows if x["impl"] == "fla" and x["T"] == 8192 and x["pass"] == "fwd"][0]
    check(abs(ratio(rows, r) - 0.8 / 1.6) < 1e-9, "ratio fla %s" % ratio(rows, r))
    r = [x for x in rows if x["impl"] == "mdy666" and x["G"] == 4][0]
    check(ratio(rows, r) is None, "no G=4 nsa row -> no ratio")
    r = [x for x in rows if x["impl"] == "cudnn" and x["T"] == 8192 and x["pass"] == "fwd"][0]
    check(abs(r["tflops"] - dense_flops(8192, 64, 128, "fwd") / 1.9 / 1e9) < 0.01, "tflops")
    check(abs(ratio(rows, r) - 2.85 / 1.9) < 1e-9, "cudnn against nsa attention dense")
    r = [x for x in rows if x["impl"] == "nsa" and x["variant"] == "attention" and x["T"] == 8192][0]
    check(abs(r["tflops"] - dense_flops(8192, 64, 128, "fwd") / 2.85 / 1e9) < 0.01, "nsa dense tflops")
    r = [x for x in rows if x["impl"] == "flex" and x["T"] == 8192 and x["pass"] == "fwd"][0]
    check(ratio(rows, r) is None, "no nsa window row -> no flex ratio")
    check(set(["impl", "config", "G", "T", "pass", "ms", "tflops", "gpu"]) <= set(r), "row keys")
    check(json.loads(json.dumps(rows)) == rows, "rows are JSON")
    for bad in (("xx", "paper"), ("nsa", "wide")):
        try:
            make_row(bad[0], "v", bad[1], 16, 8192, "fwd", 1.0, gpu, 64, 4, 128, True)
            check(False, "bad row accepted %s" % (bad,))
        except ValueError:
            pass
    table = format_table(rows, [{"impl": "fla", "variant": "parallel_nsa", "config": "fla", "G": 4, "T": 8192,
                                 "pass": "fwd", "reason": "fla needs G >= 16, a power of 2"}])
    check("0.500" in table and "skipped:" in table and "fla needs G" in table, "table content")
    check(table.index(" 16 ") < table.index("   4 "), "G=16 before G=4")
    print(table)
    check(record_argv(["decode.py", "--out", "/m/out", "--ctx=64k"], "/m/out") == ["decode.py", "--out", "<out>", "--ctx=64k"]
          and record_argv(["flex.py", "--out=/m/out"], "/m/out") == ["flex.py", "--out=<out>"]
          and record_argv(["flex.py", "--T", "4k"], None) == ["flex.py", "--T", "4k"], "argv without the output folder")
    with tempfile.TemporaryDirectory() as d:
        stem = result_stem(d, "2026-11-22", "NVIDIA H100 80GB HBM3")
        check(stem.endswith("2026-11-22-h100"), "stem")
        write_json(stem + ".json", rows)
        with open(stem + ".json") as f:
            check(json.load(f) == rows, "json round trip")
        why = write_png(stem + ".png", rows, "self-test")
        if why is None:
            size = os.path.getsize(stem + ".png")
            check(size > 10000, "png size %d" % size)
            if os.environ.get("PEERS_SELFTEST_PNG"):
                import shutil
                shutil.copy(stem + ".png", os.environ["PEERS_SELFTEST_PNG"])
            print("png: written (%d bytes)" % size)
        else:
            print("png: " + why)
    # a saved layer: its shape and configuration, its rows compared among themselves
    def layer(T=16384, HQ=8, H=2, D=64, **over):
        sh = dict(q=(1, T, HQ, D), k=(1, T, H, D), v=(1, T, H, D), g_cmp=(1, T, HQ), g_slc=(1, T, HQ), g_swa=(1, T, HQ),
                  k_cmp=(1, 2047, H, D), v_cmp=(1, 2047, H, D))
        sh.update(over)
        return {n: s for n, s in sh.items() if s is not None}
    cfg7 = [16, 8, 32, 8, 1, 2, 128]
    T_, HQ_, H_, D_, wc = workload_shape(layer(), cfg7)
    check((T_, HQ_, H_, D_) == (16384, 8, 2, 64) and wc["slc_block"] == 32 and wc["window"] == 128, "workload shape")
    for bad, cfg in ((layer(q=(16384, 8, 64)), cfg7), (layer(HQ=6, H=4), cfg7), (layer(), cfg7[:6]),
                     (layer(), cfg7[:6] + [0]), (layer(v=(1, 16384, 2, 32)), cfg7), (layer(g_swa=(1, 16384, 4)), cfg7),
                     (layer(v_cmp=(1, 2046, 2, 64)), cfg7), (layer(k_cmp=None), cfg7)):
        try:
            workload_shape(bad, cfg)
            check(False, "bad workload accepted %s %s" % (bad, cfg))
        except ValueError:
            pass
    CONFIGS["workload"] = wc
    try:
        wrows = [make_row("nsa", "native", "workload", 4, T_, "fwd", 2.0, gpu, HQ_, H_, D_, True),
                 make_row("mdy666", "hf+flexswa", "workload", 4, T_, "fwd", 4.0, gpu, HQ_, H_, D_, True)]
        check(ratio(wrows + rows, wrows[1]) == 0.5 and wrows[0]["tflops"] > 0, "workload rows compared among themselves")
        check(len(plan_rows(["nsa", "mdy666"], [4], [T_], PASSES, H_, WORKLOAD_PLAN)) == 4, "workload plan")
    finally:
        del CONFIGS["workload"]
    print("plan of the default run: %d measurements" % len(plan_rows(IMPLS, [16, 4], parse_T("8k,16k,32k,64k,128k"), PASSES)))
    for f in fails:
        print("FAIL " + f)
    print("%d passed, %d failed" % (count[0] - len(fails), len(fails)))
    return 0 if not fails else 1


# ==== the GPU part ===============================================================================


def raise_compile_limits(torch):
    """One compile of FlexAttention per (mods, T, G, layout): past torch's recompile limit a
    compiled flex_attention silently runs eagerly (materialising T x T scores), so a benchmark
    that sweeps configurations in one process raises the limit first."""
    dyn = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(dyn, name):
            setattr(dyn, name, max(getattr(dyn, name), 256))


class Timer:
    """Median time of a call: CUDA events after `warmup` calls, the L2 flushed (a 256 MiB write)
    before each of `reps` timed calls, so each run reads its inputs from memory; on the CPU
    perf_counter. Returns milliseconds."""

    def __init__(self, torch, device, reps, warmup):
        self.torch, self.dev, self.reps, self.warmup = torch, device, reps, warmup
        self.flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def ms(self, fn):
        import statistics
        import time
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        if self.dev.type != "cuda":
            ts = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ts)
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for s, e in zip(starts, ends):
            self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


class Skip(Exception):
    """This (impl, G, T) cannot run; the message is the reason recorded."""


def gpu_info():
    """nvidia-smi's view of GPU 0: name, driver and clocks (a dict; {} without nvidia-smi)."""
    fields = ["name", "driver_version", "memory.total", "clocks.sm", "clocks.max.sm", "clocks.mem",
              "clocks.max.mem", "power.limit", "temperature.gpu"]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    if not out:
        return {}
    vals = [v.strip() for v in out[0].split(",")]
    return dict(zip(fields, vals))


def record_argv(argv, out):
    """argv as a results file keeps it: the output folder (a path of the machine that ran it)
    written as <out>."""
    return ["<out>" if out and a == out else a.replace("=" + out, "=<out>") if out else a for a in argv]


def device_description(torch, device):
    """(gpu_info(), the device's name, gpu_string of both) for a torch device; "cpu" on the CPU."""
    info = gpu_info() if device.type == "cuda" else {}
    name = info.get("name") or (torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu")
    return info, name, gpu_string(info, name)


def gpu_string(info, fallback_name):
    if not info:
        return fallback_name
    return "%s, driver %s, sm %s/%s, mem %s/%s" % (
        info.get("name", fallback_name), info.get("driver_version", "?"), info.get("clocks.sm", "?"),
        info.get("clocks.max.sm", "?"), info.get("clocks.mem", "?"), info.get("clocks.max.mem", "?"))


def _drop_modules(prefix):
    for m in list(sys.modules):
        if m == prefix or m.startswith(prefix + "."):
            del sys.modules[m]


def _bare_package(name, path):
    """Registers package `name` without running its __init__.py (whose imports of optional parts
    -- fla.layers/fla.models need transformers, flash_nsa's the megatron and inference parts --
    can fail on an image that has what the timed op needs)."""
    mod = types.ModuleType(name)
    mod.__path__ = [path]
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod


def load_fla(peers):
    """fla.ops.nsa.parallel_nsa from peers/fla (fla/ops/nsa/parallel.py: parallel_nsa(q, k, v,
    g_cmp, g_slc, g_swa, block_indices, block_counts=16, block_size=64, window_size=0, scale,
    cu_seqlens); q [B, T, HQ, K], k/v [B, T, H, K/V], gates [B, T, HQ]; asserts G = HQ/H a power
    of 2 >= 16; window_size > 0 calls flash_attn_func). Returns (fn, how) or raises Skip."""
    root = os.path.join(peers, "fla")
    if not os.path.isfile(os.path.join(root, "fla", "ops", "nsa", "parallel.py")):
        raise Skip("peer fla absent: no %s/fla/ops/nsa/parallel.py (bash scripts/fetch-peers.sh)" % root)
    sys.path.insert(0, root)
    try:
        from fla.ops.nsa import parallel_nsa
        return parallel_nsa, "import fla.ops.nsa"
    except Exception as e:  # noqa: BLE001 -- any import failure is a reason to retry bare
        first = "%s: %s" % (type(e).__name__, e)
    _drop_modules("fla")
    try:
        _bare_package("fla", os.path.join(root, "fla"))
        _bare_package("fla.ops", os.path.join(root, "fla", "ops"))
        from fla.ops.nsa.parallel import parallel_nsa
        return parallel_nsa, "fla.ops.nsa.parallel without fla/__init__ and fla/ops/__init__ (%s)" % first
    except Exception as e:  # noqa: BLE001
        raise Skip("peer fla does not import: %s; bare retry: %s: %s" % (first, type(e).__name__, e))


def load_mdy666(peers):
    """flash_nsa.modules.hf_level_nsa from peers/mdy666 (HFNSACore(config).forward(q, k, v,
    combine_weight, cu_seqlens): q [t, HQ, D], k/v [t, H, D] packed, combine_weight [t, HQ, 3]
    (sigmoid inside), cu_seqlens int32 [N + 1]; window branch = the module global
    swa_varlen_func(q, k, v, sm_scale), flash-attn 3 or 2 else ImportError). Returns the module."""
    root = os.path.join(peers, "mdy666")
    if not os.path.isfile(os.path.join(root, "flash_nsa", "modules", "hf_level_nsa.py")):
        raise Skip("peer mdy666 absent: no %s/flash_nsa/modules/hf_level_nsa.py (bash scripts/fetch-peers.sh)" % root)
    sys.path.insert(0, root)
    try:  # flash_nsa/utils.py imports pkg_resources (only for parse_version); newer setuptools lack it
        importlib.import_module("pkg_resources")
    except ImportError:
        from packaging import version as _v
        shim = types.ModuleType("pkg_resources")
        shim.parse_version = _v.parse
        sys.modules["pkg_resources"] = shim
    try:  # hf_level_nsa.py imports pandas (only for its bench=True printout)
        importlib.import_module("pandas")
    except ImportError:
        sys.modules["pandas"] = types.ModuleType("pandas")
    try:
        import flash_nsa.modules.hf_level_nsa as hf
        return hf, "import flash_nsa"
    except Exception as e:  # noqa: BLE001
        first = "%s: %s" % (type(e).__name__, e)
    _drop_modules("flash_nsa")
    try:
        _bare_package("flash_nsa", os.path.join(root, "flash_nsa"))
        _bare_package("flash_nsa.modules", os.path.join(root, "flash_nsa", "modules"))
        import flash_nsa.modules.hf_level_nsa as hf
        return hf, "flash_nsa.modules.hf_level_nsa without the package __init__s (%s)" % first
    except Exception as e:  # noqa: BLE001
        raise Skip("peer mdy666 does not import: %s; bare retry: %s: %s" % (first, type(e).__name__, e))


class Runner:
    """Holds torch, the peers and the options; measure() times one closure."""

    def __init__(self, torch, args):
        self.torch = torch
        self.args = args
        self.dev = torch.device("cuda")
        self.cache = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=self.dev)
        self.flex = None
        self.flex_error = None
        self.flex_contig = False
        self.block_masks = {}

    # -- timing --
    def measure(self, fn, grads):
        """Median ms of fn over up to --reps runs after --warmup runs; each run starts from a
        flushed L2, with the grads of `grads` set to None before it (as do_bench's grad_to_none)."""
        torch = self.torch
        for _ in range(self.args.warmup):
            for g in grads:
                g.grad = None
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for g in grads:
            g.grad = None
        self.cache.zero_()
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        probe = s.elapsed_time(e)
        reps = max(1, min(self.args.reps, int(self.args.max_seconds * 1000.0 / max(probe, 1e-3))))
        if reps <= 1:
            return probe, 1
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            for g in grads:
                g.grad = None
            self.cache.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), reps

    # -- FlexAttention --
    def flex_fn(self):
        if self.flex is None:
            from torch.nn.attention.flex_attention import flex_attention
            raise_compile_limits(self.torch)
            self.flex = self.torch.compile(flex_attention, dynamic=False)
        return self.flex

    def probe_flex(self):
        """None if compiled FlexAttention runs forward + backward on a small GQA problem, in
        [1, h, t, d] layout and as transposed views of packed [t, h, d] (mdy666's layout; if the
        views fail but copies work, flex_contig is set); else the reason."""
        torch = self.torch
        try:
            flex, bm = self.flex_fn(), self.block_mask(1024, WINDOW - 1)
            q, k, v = self.randn(1, 4, 1024, self.args.D), self.randn(1, 1, 1024, self.args.D), \
                self.randn(1, 1, 1024, self.args.D)
            flex(q, k, v, block_mask=bm, enable_gqa=True).float().sum().backward()
            qp, kp, vp = self.randn(1024, 4, self.args.D), self.randn(1024, 1, self.args.D), \
                self.randn(1024, 1, self.args.D)
            try:
                o = flex(qp.transpose(0, 1).unsqueeze(0), kp.transpose(0, 1).unsqueeze(0),
                         vp.transpose(0, 1).unsqueeze(0), block_mask=bm, enable_gqa=True).squeeze(0).transpose(0, 1)
                o.backward(torch.randn_like(o))  # strided like the grad mdy666's combine gives back (empty_like)
            except Exception:  # noqa: BLE001
                self.flex_contig = True
            torch.cuda.synchronize()
            return None
        except Exception as e:  # noqa: BLE001
            if self.args.verbose:
                traceback.print_exc()
            return "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:240] if str(e) else "")
        finally:
            self.block_masks = {}

    def block_mask(self, T, left):
        """Causal window: query i sees keys j with i - left <= j <= i (left = 511: 512 keys,
        nsa's w = 512; left = 512: flash-attn's window_size=(512, -1) that mdy666 passes)."""
        key = (T, left)
        if key not in self.block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            def swa(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (q_idx - kv_idx <= left)
            self.block_masks = {}  # one T at a time
            try:  # compiled: the eager builder materialises the T x T boolean mask (17 GB at 128k)
                bm = create_block_mask(swa, B=None, H=None, Q_LEN=T, KV_LEN=T, device=self.dev, _compile=True)
            except Exception:  # noqa: BLE001 -- a torch without _compile, or a failed compile
                bm = create_block_mask(swa, B=None, H=None, Q_LEN=T, KV_LEN=T, device=self.dev)
            self.block_masks[key] = bm
        return self.block_masks[key]

    # -- inputs --
    def randn(self, *shape, grad=True):
        x = self.torch.randn(*shape, dtype=self.torch.bfloat16, device=self.dev)
        return x.requires_grad_(grad)

    def gates(self, *shape):
        return self.torch.rand(*shape, dtype=self.torch.bfloat16, device=self.dev).requires_grad_(True)

    def saved(self, name, grad=True):
        """--workload: the saved layer's array `name` as a bf16 tensor on the GPU."""
        x = self.torch.from_numpy(self.workload[name].astype("float32")).to(self.dev, self.torch.bfloat16)
        return x.requires_grad_(grad)

    # -- one implementation: returns (forward closure, leaves with grads, note) --
    def setup(self, impl, variant, config, G, T):
        torch, a = self.torch, self.args
        HQ, H, D = a.H * G, a.H, a.D
        if impl == "nsa" and config == "workload":
            import nsa
            q, k, v, g_cmp, g_slc, g_swa, k_cmp, v_cmp = [self.saved(n) for n in WORKLOAD_ARRAYS]
            cfg = nsa.Config(**CONFIGS["workload"])
            swa_gate = g_swa if variant == "native" else None
            leaves = [q, k, v, g_cmp, g_slc] + ([g_swa] if swa_gate is not None else []) + [k_cmp, v_cmp]
            return (lambda: nsa.native_sparse_attention(q, k, v, g_cmp, g_slc, swa_gate, config=cfg, k_cmp=k_cmp,
                                                        v_cmp=v_cmp)), leaves, "the layer's learned k_cmp / v_cmp"
        if impl == "nsa":
            import nsa
            q, k, v = self.randn(1, T, HQ, D), self.randn(1, T, H, D), self.randn(1, T, H, D)
            g_cmp, g_slc, g_swa = self.gates(1, T, HQ), self.gates(1, T, HQ), self.gates(1, T, HQ)
            leaves = [q, k, v, g_cmp, g_slc, g_swa]
            if variant == "attention":  # python/nsa/__init__.py: attention (autograd through nsa_attention_bwd)
                if config == "dense":
                    kvh = HQ if a.dense_kv == "HQ" else H  # as the SDPA rows
                    k, v = self.randn(1, T, kvh, D), self.randn(1, T, kvh, D)
                    return (lambda: nsa.attention(q, k, v, causal=True).o), [q, k, v], "k/v with %d heads" % kvh
                return (lambda: nsa.attention(q, k, v, causal=True, window=(WINDOW - 1, 0)).o), [q, k, v], None
            if variant == "parallel_nsa":  # python/nsa/__init__.py: parallel_nsa (fla's arguments)
                c = CONFIGS["fla"]
                return (lambda: nsa.parallel_nsa(q, k, v, g_cmp, g_slc, None, block_counts=c["slc_topk"],
                                                 block_size=c["slc_block"], window_size=0)), leaves[:5], None
            cfg = nsa.Config(n_init=1, n_local=2, **CONFIGS[config])  # python/nsa/_core.py: Config
            swa_gate = g_swa if variant == "native" and config == "paper" else None
            return (lambda: nsa.native_sparse_attention(q, k, v, g_cmp, g_slc, swa_gate, config=cfg)), \
                leaves if swa_gate is not None else leaves[:5], None
        if impl == "fla":
            if G < 16 or G & (G - 1):
                raise Skip("fla asserts G = HQ/H a power of 2 >= 16 (fla/ops/nsa/parallel.py)")
            q, k, v = self.randn(1, T, HQ, D), self.randn(1, T, H, D), self.randn(1, T, H, D)
            g_cmp, g_slc = self.gates(1, T, HQ), self.gates(1, T, HQ)
            c = CONFIGS["fla"]
            fla_fn = self.fla
            return (lambda: fla_fn(q, k, v, g_cmp, g_slc, None, block_counts=c["slc_topk"], block_size=c["slc_block"],
                               window_size=0)), [q, k, v, g_cmp, g_slc], None
        if impl == "mdy666":
            hf = self.mdy
            c = CONFIGS[config]
            # flash_nsa/config.py NSAConfig; HFNSACore reads kernel_size, stride, block_size, top_n,
            # num_init_blocks, num_local_blocks, window_size (flash_nsa/modules/hf_level_nsa.py)
            ncfg = hf.NSAConfig(head_dim=D, num_heads=HQ, num_kv_heads=H, kernel_size=c["cmp_len"],
                                stride=c["cmp_stride"], block_size=c["slc_block"], top_n=c["slc_topk"],
                                num_init_blocks=c.get("n_init", 1), num_local_blocks=c.get("n_local", 2),
                                window_size=c["window"])
            hf.NSAHelper.x_cu_seqlens = None  # its varlen cache is global: start clean per shape
            core = hf.HFNSACore(ncfg).to(self.dev)
            if config == "workload":  # the layer's q, k, v packed (leaves); its gates as combine weights (logits)
                q, k, v = [self.saved(n, False)[0].requires_grad_(True) for n in ("q", "k", "v")]
                g = torch.stack([self.saved(n, False)[0].float() for n in ("g_cmp", "g_slc", "g_swa")], -1)
                g = g.clamp(1e-4, 1 - 1e-4)
                w = torch.log(g / (1 - g)).to(torch.bfloat16).requires_grad_(True)
            else:
                q, k, v = self.randn(T, HQ, D), self.randn(T, H, D), self.randn(T, H, D)
                w = self.randn(T, HQ, 3)  # combine weights, sigmoid applied inside (ops/combine.py)
            cu = torch.tensor([0, T], dtype=torch.int32, device=self.dev)
            note = None
            if variant == "hf+flexswa":
                flex, left = self.flex_fn(), hf.NSAHelper.window_size
                bm = self.block_mask(T, left)

                contig = self.flex_contig

                def bhtd(x):  # packed [t, h, d] -> flex's [1, h, t, d] (a view unless the probe needed copies)
                    x = x.transpose(0, 1).unsqueeze(0)
                    return x.contiguous() if contig else x

                def swa_flex(q_, k_, v_, sm_scale=None):
                    o = flex(bhtd(q_), bhtd(k_), bhtd(v_), block_mask=bm, scale=sm_scale, enable_gqa=True)
                    return o.squeeze(0).transpose(0, 1)
                hf.swa_varlen_func = swa_flex
                note = "window: compiled FlexAttention%s, %d keys left + self (its flash-attn window_size=(%d,-1))" % (
                    " on contiguous copies" if contig else "", left, left)
            else:
                hf.swa_varlen_func = lambda q_, k_, v_, sm_scale=None: torch.zeros_like(q_)
                note = "window branch replaced by zeros: compression + top-n + selection + combine timed"
            return (lambda: core(q, k, v, w, cu)), [q, k, v, w], note
        if impl in ("cudnn", "fa2"):
            from torch.nn.attention import SDPBackend, sdpa_kernel
            backend = SDPBackend.CUDNN_ATTENTION if impl == "cudnn" else SDPBackend.FLASH_ATTENTION
            kvh = HQ if a.dense_kv == "HQ" else H
            q, k, v = self.randn(1, HQ, T, D), self.randn(1, kvh, T, D), self.randn(1, kvh, T, D)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            extra = {} if kvh == HQ else {"enable_gqa": True}

            def sdpa_call():
                with sdpa_kernel(backend):
                    return sdpa(q, k, v, is_causal=True, **extra)
            return sdpa_call, [q, k, v], "k/v with %d heads" % kvh
        if impl == "flex":
            if self.flex_error:
                raise Skip("FlexAttention failed on a small problem: " + self.flex_error)
            flex, bm = self.flex_fn(), self.block_mask(T, WINDOW - 1)
            q, k, v = self.randn(1, HQ, T, D), self.randn(1, H, T, D), self.randn(1, H, T, D)
            return (lambda: flex(q, k, v, block_mask=bm, enable_gqa=True)), [q, k, v], None
        raise Skip("unknown impl %s" % impl)


def kernel_table(torch, fn, leaves, top, title):
    """--kernels N: one more run of fn under torch.profiler, and its N longest GPU kernels
    (summed per name, ms) -- where each implementation's time goes, for Triton peers and nsa
    alike, without ncu (which did not finish under torch.compile within a 10-minute run)."""
    from torch.profiler import ProfilerActivity, profile
    for g in leaves:
        g.grad = None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.events():
        t = getattr(ev, "device_time", None)
        if t is None:
            t = getattr(ev, "cuda_time", 0.0)
        if t and getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type):
            per[ev.name] = per.get(ev.name, 0.0) + t / 1000.0
    total = sum(per.values())
    print("    kernels of %s: %.3f ms on the GPU" % (title, total))
    for name, ms in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
        print("      %9.3f ms  %s" % (ms, name[:110]))


def run(args):
    """The GPU run. Returns the process exit code."""
    try:
        import torch
    except ImportError as e:
        print("peers.py: torch not available (%s); this benchmark needs PyTorch and a CUDA GPU "
              "(python3 bench/peers.py --list / --self-test run without)" % e, file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("peers.py: CUDA not available (torch %s sees no GPU); nothing timed" % torch.__version__, file=sys.stderr)
        return 2
    t_start = time.time()
    info, name, gpu = device_description(torch, torch.device("cuda"))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    os.makedirs(args.out, exist_ok=True)
    stem = result_stem(args.out, date, name, args.tag)
    peers = os.environ.get("NSA_PEERS") or os.path.join(REPO, "peers")
    print("gpu: %s\nresults: %s.{json,meta.json,png}\npeers: %s" % (gpu, stem, peers), flush=True)

    runner = Runner(torch, args)
    unavailable = {}  # impl -> reason
    impls = [i for i in args.impl]
    if "nsa" in impls:
        sys.path.insert(0, os.path.join(REPO, "python"))
        try:
            import nsa
            if not nsa.torch_available():
                unavailable["nsa"] = "nsa's torch integration is not loaded (NSA_NO_TORCH=1?)"
            elif not nsa.backend_available("cuda"):
                unavailable["nsa"] = "libnsa has no usable CUDA backend (build with nvcc: make build/libnsa.so)"
            else:
                print("nsa: %s, library %s" % (nsa.version(), getattr(nsa.library, "_name", "?")), flush=True)
        except Exception as e:  # noqa: BLE001
            unavailable["nsa"] = "import nsa failed: %s: %s" % (type(e).__name__, e)
    how = {}
    if "fla" in impls:
        try:
            runner.fla, how["fla"] = load_fla(peers)
        except Skip as e:
            unavailable["fla"] = str(e)
    if "mdy666" in impls:
        try:
            runner.mdy, how["mdy666"] = load_mdy666(peers)
        except Skip as e:
            unavailable["mdy666"] = str(e)
        except Exception as e:  # noqa: BLE001
            unavailable["mdy666"] = "%s: %s" % (type(e).__name__, e)
    if "cudnn" in impls and not torch.backends.cudnn.is_available():
        unavailable["cudnn"] = "torch.backends.cudnn not available"
    for impl, why in unavailable.items():
        print("skip %s: %s" % (impl, why), flush=True)
    for impl, h in how.items():
        print("%s: %s" % (impl, h), flush=True)

    rows, skipped = [], []
    meta = {"gpu": info, "gpu_string": gpu, "date": date, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "python": sys.version.split()[0],
            "argv": sys.argv, "peers_dir": peers,
            "peer_commits": {n: peer_commit(peers, n) for n in ("fla", "mdy666")}, "imports": how,
            "unavailable": unavailable, "skipped": skipped, "timing": "CUDA events, L2 flushed (256 MB zeroed) "
            "before each run, median of up to --reps runs after --warmup runs",
            "args": {k: v for k, v in vars(args).items() if k != "workload_arrays"}}
    if args.workload_arrays is not None:  # the saved layer's arrays are not JSON: their shapes stand for them
        meta["workload_shapes"] = {n: list(a.shape) for n, a in args.workload_arrays.items()}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass

    def save():
        write_json(stem + ".json", rows)
        meta["elapsed_s"] = round(time.time() - t_start, 1)
        write_json(stem + ".meta.json", meta)

    def skip(impl, variant, config, G, T, p, reason):
        s = {"impl": impl, "variant": variant, "config": config, "G": G, "T": T, "pass": p, "reason": reason}
        skipped.append(s)
        print("  skip %s %s %s G=%d T=%s %s: %s" % (impl, variant, config, G, fmt_T(T), p, reason), flush=True)

    plan = list(WORKLOAD_PLAN if args.workload else PLAN)
    runner.workload = args.workload_arrays
    mdy_variant = "hf+flexswa" if not args.mdy_noswa else "hf-noswa"
    if "flex" in impls or ("mdy666" in impls and mdy_variant == "hf+flexswa"):
        runner.flex_error = runner.probe_flex()
        print("flex: %s" % (runner.flex_error or ("works" + (" (packed views copied to contiguous)"
                                                             if runner.flex_contig else ""))), flush=True)
        meta["flex"] = runner.flex_error or ("contiguous copies" if runner.flex_contig else "views")
        if runner.flex_error:
            unavailable["flex"] = "FlexAttention failed on a small problem: " + runner.flex_error
            if "mdy666" in impls and not args.no_fallback:
                mdy_variant = "hf-noswa"  # time what mdy666 has without flash-attn: window branch = 0
    oom_at = {}  # (impl, variant, config, G, pass) -> T that ran out of memory
    stop = False
    for G in args.G:
        for T in args.T:
            for impl, variant, config, window in plan:
                if stop or impl not in impls:
                    continue
                if impl == "mdy666" and variant != mdy_variant:
                    continue
                if variant == "native-noswa" and mdy_variant != "hf-noswa":
                    continue
                if impl == "nsa" and config not in args.nsa_configs and variant != "native-noswa":
                    continue
                passes = [p for p in args.passes]
                if impl in unavailable:
                    if G == args.G[0] and T == args.T[0]:
                        skipped.append({"impl": impl, "variant": variant, "config": config, "G": "all", "T": "all",
                                        "pass": "all", "reason": unavailable[impl]})
                    continue
                if time.time() - t_start > args.time_limit:
                    print("time limit (%d s) reached: no more measurements" % args.time_limit, flush=True)
                    stop = True
                    continue
                todo = []
                for p in passes:
                    k = (impl, variant, config, G, p)
                    if k in oom_at and oom_at[k] < T:
                        skip(impl, variant, config, G, T, p, "out of memory at T=%s" % fmt_T(oom_at[k]))
                    else:
                        todo.append(p)
                if not todo:
                    continue
                HQ, H, D = args.H * G, args.H, args.D
                fn = leaves = note = do = step = None
                try:
                    fn, leaves, note = runner.setup(impl, variant, config, G, T)
                    for p in todo:
                        try:
                            if p == "fwd":
                                ms, runs = runner.measure(fn, leaves)
                            else:
                                o = fn()
                                do = torch.randn_like(o)
                                del o
                                step = lambda: fn().backward(do)  # noqa: E731
                                ms, runs = runner.measure(step, leaves)
                            row = make_row(impl, variant, config, G, T, p, ms, gpu, HQ, H, D, window, runs, note)
                            rows.append(row)
                            if args.kernels:
                                kernel_table(torch, fn if p == "fwd" else step, leaves, args.kernels,
                                             "%s %s %s G=%d T=%s %s" % (impl, variant, config, G, fmt_T(T), p))
                            print("  %-7s %-13s %-8s G=%-2d T=%-5s %-8s %10.3f ms %8s TFLOP/s  (%d runs)" % (
                                impl, variant, config, G, fmt_T(T), p, ms,
                                "-" if row["tflops"] is None else "%.1f" % row["tflops"], runs), flush=True)
                        except torch.cuda.OutOfMemoryError:
                            oom_at[(impl, variant, config, G, p)] = T
                            skip(impl, variant, config, G, T, p, "out of memory")
                        except Exception as e:  # noqa: BLE001 -- unsupported shapes, compile errors, ...
                            if args.verbose:
                                traceback.print_exc()
                            if "out of memory" in str(e).lower() or "alloc_failed" in str(e).lower():
                                oom_at[(impl, variant, config, G, p)] = T
                            skip(impl, variant, config, G, T, p, "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:240]
                                                                            if str(e) else ""))
                except torch.cuda.OutOfMemoryError:
                    for p in todo:
                        oom_at[(impl, variant, config, G, p)] = T
                        skip(impl, variant, config, G, T, p, "out of memory (inputs)")
                except Skip as e:
                    for p in todo:
                        skip(impl, variant, config, G, T, p, str(e))
                except Exception as e:  # noqa: BLE001
                    if args.verbose:
                        traceback.print_exc()
                    for p in todo:
                        skip(impl, variant, config, G, T, p, "setup: %s: %s" % (type(e).__name__, str(e).splitlines()[0][:240]
                                                                               if str(e) else ""))
                fn = leaves = do = step = None  # step's closure holds dout; fn's the inputs
                gc.collect()
                torch.cuda.empty_cache()
                save()
        runner.block_masks = {}
    meta["gpu_end"] = gpu_info()
    save()
    print()
    print(format_table(rows, skipped))
    why = write_png(stem + ".png", rows, gpu)
    print("png: %s" % (why or stem + ".png"))
    print("json: %s.json (%d rows), %s.meta.json (%d skipped)" % (stem, len(rows), stem, len(skipped)))
    return 0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", default="8k,16k,32k,64k,128k", help="lengths, e.g. 8k,16k,32768 (default %(default)s)")
    ap.add_argument("--G", default="16,4", help="GQA ratios HQ/H (default %(default)s; HQ = G * H)")
    ap.add_argument("--H", type=int, default=4, help="kv heads (default %(default)s)")
    ap.add_argument("--D", type=int, default=128, help="head dim (default %(default)s)")
    ap.add_argument("--impl", default=",".join(IMPLS), help="subset of %s" % ",".join(IMPLS))
    ap.add_argument("--pass", dest="passes", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both")
    ap.add_argument("--nsa-configs", default="paper,fla,dense,swa",
                    help="nsa rows to time: paper, fla (NSA), dense, swa (nsa.attention; default all)")
    ap.add_argument("--reps", type=int, default=10, help="timed runs per measurement, median (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs first (compile, autotune; default %(default)s)")
    ap.add_argument("--max-seconds", type=float, default=4.0,
                    help="cap on one measurement's timed runs (a run longer than this is timed once)")
    ap.add_argument("--time-limit", type=float, default=540.0,
                    help="start no new measurement after this many seconds (default %(default)s)")
    ap.add_argument("--dense-kv", choices=("HQ", "H"), default="HQ",
                    help="dense SDPA k/v heads: HQ (k/v materialised per query head, default) or H (enable_gqa)")
    ap.add_argument("--mdy-noswa", action="store_true",
                    help="mdy666 without its window branch (zeros) and nsa paper config with g_swa=None beside it")
    ap.add_argument("--no-fallback", action="store_true",
                    help="when FlexAttention fails on the probe, skip mdy666 instead of timing it without window")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder of the JSON/PNG (default bench/results)")
    ap.add_argument("--tag", default=None, help="appended to the file names: <date>-<gpu>-<tag>.json")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="after each row, its N longest GPU kernels from one torch.profiler run (0: off)")
    ap.add_argument("--list", action="store_true", help="print the plan and FLOP counts and exit (no torch)")
    ap.add_argument("--self-test", action="store_true", help="check the pure functions and exit (no torch)")
    ap.add_argument("-v", "--verbose", action="store_true", help="tracebacks of failures")
    ap.add_argument("--workload", default=None, metavar="NPZ",
                    help="one saved layer's inputs (bench/workload.py) instead of random ones: nsa and mdy666 at its "
                         "T, heads and NSA configuration (--T, --G, --H, --D, --impl, --nsa-configs are then set from it)")
    args = ap.parse_args(argv)
    args.T = parse_T(args.T)
    args.G = [int(g) for g in args.G.split(",") if g.strip()]
    args.impl = [i.strip() for i in args.impl.split(",") if i.strip()]
    args.passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    args.nsa_configs = [c.strip() for c in args.nsa_configs.split(",") if c.strip()]
    for i in args.impl:
        if i not in IMPLS:
            ap.error("--impl: %r is not one of %s" % (i, ",".join(IMPLS)))
    for p in args.passes:
        if p not in PASSES:
            ap.error("--pass: %r is not one of %s" % (p, ",".join(PASSES)))
    for c in args.nsa_configs:
        if c not in list(CONFIGS) + ["dense", "swa"]:
            ap.error("--nsa-configs: %r is not one of %s,dense,swa" % (c, ",".join(CONFIGS)))
    if not args.T or min(args.T) < 64 or not args.G or min(args.G) < 1:
        ap.error("need T >= 64 and G >= 1")
    args.workload_arrays = None
    if args.workload:
        import numpy as np
        try:
            with np.load(args.workload) as npz:  # read once (each lookup in an npz file reads the array again)
                data = {n: npz[n] for n in npz.files if n in WORKLOAD_ARRAYS + ("config",)}
            if "config" not in data:
                raise ValueError("workload: lacks config (bench/workload.py writes it)")
            T, HQ, H, D, cfg = workload_shape({n: a.shape for n, a in data.items() if n != "config"}, data["config"])
        except Exception as e:  # noqa: BLE001 -- unreadable files (OSError, zipfile.BadZipFile, pickles refused) too
            ap.error("--workload: %s: %s" % (args.workload, e))
        CONFIGS["workload"] = cfg
        args.T, args.G, args.H, args.D = [T], [HQ // H], H, D
        args.impl = [i for i in args.impl if i in ("nsa", "mdy666")]
        args.nsa_configs = ["workload"]
        args.workload_arrays = data
    return args


def list_plan(args):
    """--list: what a run would measure and the FLOPs each row's TFLOP/s divides by."""
    print("%-7s %-13s %-8s %3s %6s %-8s %14s" % ("impl", "variant", "config", "G", "T", "pass", "TFLOP counted"))
    n = 0
    plan = WORKLOAD_PLAN if args.workload else None
    for impl, variant, config, window, G, T, p in plan_rows(args.impl, args.G, args.T, args.passes, args.H, plan):
        if impl == "nsa" and config not in args.nsa_configs:
            continue
        f = row_flops(impl, config, window, T, args.H * G, args.H, args.D, p) / 1e12
        print("%-7s %-13s %-8s %3d %6s %-8s %14.3f" % (impl, variant, config, G, fmt_T(T), p, f))
        n += 1
    print("%d measurements (fla skips G not a power of 2 >= 16 at run time)" % n)
    return 0


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.self_test:
        return self_test()
    if args.list:
        return list_plan(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
