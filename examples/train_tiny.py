#!/usr/bin/env python3
"""Train a tiny byte-level decoder LM twice, NSA attention and full attention side by side.

Data: the Python standard library's own source files (*.py next to the `os` module), as
bytes: real text that every machine has offline; the last 5% is held out. Both runs use the
same seed, the same initial weights of every shared layer, the same batches in the same
order and the same steps, and start from the same embedding, MLP and q/k/v weights; only the
attention layer differs (nsa.nn.NativeSparseAttention vs causal softmax attention with the
same projections, GQA and RoPE). Prints both loss curves and
writes <out>/loss.png and <out>/loss.csv.

    PYTHONPATH=python python3 examples/train_tiny.py                 # GPU, a few minutes on one H100
    PYTHONPATH=python python3 examples/train_tiny.py --steps 50 --device cpu --tiny
"""
import argparse
import csv
import math
import os
import struct
import sys
import time
import zlib

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import nsa  # noqa: E402
import nsa.nn  # noqa: E402


def load_text(max_bytes):
    """Bytes of the standard library's .py files (sorted, so every run reads the same text)."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        for f in sorted(files):
            if f.endswith(".py"):
                try:
                    with open(os.path.join(d, f), "rb") as fh:
                        b = fh.read()
                except OSError:
                    continue
                chunks.append(b)
                total += len(b)
                if total >= max_bytes:
                    return b"".join(chunks)[:max_bytes]
    return b"".join(chunks)


# ---- the model ----------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.w.to(x.dtype)


class FullAttention(nn.Module):
    """Causal softmax attention with the same projections, GQA and RoPE as the NSA layer."""

    def __init__(self, d, heads, kv_heads, head_dim):
        super().__init__()
        self.h, self.kvh, self.hd = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        nn.init.normal_(self.o_proj.weight, std=0.02 / math.sqrt(2))
        self.rope = nsa.nn.RotaryEmbedding(head_dim)

    def forward(self, x):
        B, T, _ = x.shape
        pos = torch.arange(T, device=x.device)
        q = self.rope(self.q_proj(x).view(B, T, self.h, self.hd), pos).transpose(1, 2)
        k = self.rope(self.k_proj(x).view(B, T, self.kvh, self.hd), pos).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kvh, self.hd).transpose(1, 2)
        g = self.h // self.kvh
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.h * self.hd))


class Block(nn.Module):
    def __init__(self, d, attn):
        super().__init__()
        self.n1, self.n2, self.attn = RMSNorm(d), RMSNorm(d), attn
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)
        nn.init.normal_(self.down.weight, std=0.02 / math.sqrt(2))

    def forward(self, x, cache=None, q_lens=None):
        # cache: the NSA layer's KV cache (examples/generate.py): x holds only the new tokens
        a = self.attn(self.n1(x)) if cache is None else self.attn(self.n1(x), cache=cache, q_lens=q_lens)
        x = x + a
        return x + self.down(F.gelu(self.up(self.n2(x))))


class TinyLM(nn.Module):
    def __init__(self, kind, args, config):
        super().__init__()
        d = args.d_model
        # Each part from its own seed: the embedding, the MLPs and the q/k/v projections (made
        # first in both attention layers) start identical in the two models.
        torch.manual_seed(args.seed)
        self.emb = nn.Embedding(256, d)
        nn.init.normal_(self.emb.weight, std=0.02)
        blocks = []
        for i in range(args.layers):
            torch.manual_seed(args.seed * 1000 + 2 * i + 1)
            if kind == "nsa":
                attn = nsa.nn.NativeSparseAttention(d, args.heads, args.kv_heads, args.head_dim, config=config)
            else:
                attn = FullAttention(d, args.heads, args.kv_heads, args.head_dim)
            torch.manual_seed(args.seed * 1000 + 2 * i + 2)
            blocks.append(Block(d, attn))
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(d)

    def forward(self, idx, caches=None, q_lens=None):
        """Logits [B, T, 256]. caches: one KV cache per block (NSA layers' new_cache): idx holds
        the new tokens of each sequence (q_lens[b] of them) after those already cached."""
        x = self.emb(idx)
        for i, b in enumerate(self.blocks):
            x = b(x) if caches is None else b(x, caches[i], q_lens)
        return self.norm(x) @ self.emb.weight.t().to(x.dtype)  # tied output layer


# ---- training ----------------------------------------------------------------------------------

def batches(data, n, batch, seq, seed, device):
    """n batches of (input, target) windows at seeded random offsets: identical for both runs."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        off = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[o:o + seq + 1] for o in off.tolist()]).long()
        yield x[:, :-1].to(device, non_blocking=True), x[:, 1:].to(device, non_blocking=True)


def train(kind, args, train_data, val_batches, config):
    device = torch.device(args.device)
    model = TinyLM(kind, args, config).to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    use_amp = device.type == "cuda" or args.dtype == "bf16"
    amp = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp)
    curve, t0, acc, n_acc = [], time.time(), 0.0, 0
    step_fn = model
    if args.compile:
        step_fn = torch.compile(model)
    for step, (x, y) in enumerate(batches(train_data, args.steps, args.batch, args.seq_len, args.seed, device), 1):
        model.train()
        with amp:
            logits = step_fn(x)
            loss = F.cross_entropy(logits.float().view(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        acc, n_acc = acc + loss.detach(), n_acc + 1  # summed on the device: no sync per step
        if step % args.eval_every == 0 or step == args.steps:
            train_loss, acc, n_acc = float(acc) / n_acc, 0.0, 0
            model.eval()
            with torch.no_grad(), amp:
                val = sum(F.cross_entropy(step_fn(vx).float().view(-1, 256), vy.reshape(-1)).item()
                          for vx, vy in val_batches) / len(val_batches)
            curve.append((step, train_loss, val))
            print("  %-4s step %5d  train %.4f  val %.4f  (%.1f s)" % (kind, step, train_loss, val, time.time() - t0),
                  flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return curve, time.time() - t0, params, model


# ---- the plot (matplotlib when present, else a small built-in PNG writer) -------------------------

def plot(curves, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 5))
        for (name, curve), color in zip(curves.items(), ("tab:red", "tab:blue")):
            ax.plot([c[0] for c in curve], [c[1] for c in curve], color=color, alpha=0.5, label=name + " train")
            ax.plot([c[0] for c in curve], [c[2] for c in curve], color=color, label=name + " val")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats / byte)")
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.savefig(path, dpi=100)
        return
    except ImportError:
        pass
    write_png_plot(curves, path)


FONT = {  # 3x5 glyphs, rows top to bottom
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", " ": "000000000000000",
    "n": "000110101101101", "s": "000111110011111", "a": "000011101101011", "f": "011100110100100",
    "u": "000101101101111", "l": "110010010010111", "v": "000101101101010", "t": "010111010010011",
    "r": "000110101100100", "i": "010000010010010", "e": "000111111100111", "p": "000111101111100",
    "o": "000111101101111", "/": "001001010100100", "-": "000000111000000",
}


def write_png_plot(curves, path, w=800, h=500):
    """Lines of val (solid) and train (dotted) loss per run, axes with min/max labels."""
    img = [[(255, 255, 255)] * w for _ in range(h)]
    L, R, T_, B_ = 60, 20, 30, 40
    pts = [p for c in curves.values() for p in c]
    xmax = max(p[0] for p in pts)
    ys = [p[i] for p in pts for i in (1, 2)]
    ylo, yhi = min(ys), max(ys)
    yhi = yhi if yhi > ylo else ylo + 1

    def px(s, v):
        return (L + int((w - L - R) * s / xmax), T_ + int((h - T_ - B_) * (yhi - v) / (yhi - ylo)))

    def put(x, y, c):
        if 0 <= x < w and 0 <= y < h:
            img[y][x] = c

    def line(a, b, c, dotted=False):
        n = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
        for i in range(n + 1):
            if dotted and (i // 3) % 2:
                continue
            x, y = a[0] + (b[0] - a[0]) * i // n, a[1] + (b[1] - a[1]) * i // n
            for dx in (0, 1):
                put(x + dx, y, c)

    def text(x, y, s, c=(0, 0, 0), k=2):
        for ch in s:
            g = FONT.get(ch, FONT[" "])
            for r in range(5):
                for col in range(3):
                    if g[r * 3 + col] == "1":
                        for a in range(k):
                            for b in range(k):
                                put(x + col * k + a, y + r * k + b, c)
            x += 4 * k

    line((L, T_), (L, h - B_), (0, 0, 0))
    line((L, h - B_), (w - R, h - B_), (0, 0, 0))
    text(4, T_, "%.2f" % yhi)
    text(4, h - B_ - 10, "%.2f" % ylo)
    text(L, h - B_ + 8, "0")
    text(w - R - 40, h - B_ + 8, str(xmax))
    text(w // 2 - 40, h - B_ + 8, "step")
    for (name, curve), color in zip(curves.items(), ((220, 40, 40), (40, 80, 220))):
        for i in range(1, len(curve)):
            line(px(curve[i - 1][0], curve[i - 1][2]), px(curve[i][0], curve[i][2]), color)
            line(px(curve[i - 1][0], curve[i - 1][1]), px(curve[i][0], curve[i][1]), color, dotted=True)
        ly = 8 if name == "nsa" else 20
        line((w - 200, ly + 4), (w - 170, ly + 4), color)
        text(w - 160, ly, name + " val")
    raw = b"".join(b"\x00" + bytes(v for px_ in row for v in px_) for row in img)

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def config_for(args):
    """The NSA config of a run. At the default scale: 16-token compressed blocks every 8, top 8 of
    32-token blocks, a 128 window (at T = 2048 each query reads at most 8*32 + 128 + 255 keys
    instead of up to 2048). --nsa-config paper: the paper's (32-token compressed blocks every 16,
    top 16 of 64-token blocks, a 512 window), whatever the model's size."""
    if getattr(args, "nsa_config", "small") == "paper":
        return nsa.Config(cmp_len=32, cmp_stride=16, slc_block=64, slc_topk=16, n_init=1, n_local=2,
                          window=min(512, args.seq_len))
    if args.tiny:
        return nsa.Config(cmp_len=16, cmp_stride=8, slc_block=16, slc_topk=3, n_init=1, n_local=2, window=32)
    return nsa.Config(cmp_len=16, cmp_stride=8, slc_block=32, slc_topk=8, n_init=1, n_local=2,
                      window=min(128, args.seq_len))


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="train_tiny_out", help="folder for loss.png and loss.csv")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--val-batches", type=int, default=4)
    ap.add_argument("--data-mb", type=float, default=16)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default=None,
                    help="autocast dtype (default: bf16 on CUDA, whose NSA backend needs it; f32 on the CPU)")
    ap.add_argument("--compile", action="store_true", help="torch.compile both models")
    ap.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (small model and sequences)")
    ap.add_argument("--save", default=None, help="write the trained NSA model here (examples/generate.py --checkpoint)")
    ap.add_argument("--nsa-config", choices=["small", "paper"], default="small",
                    help="NSA's block sizes: small (the default, sized for this model) or the paper's (with --head-dim 128 "
                         "and --heads / --kv-heads 64 / 4 or 16 / 1: the shapes the benchmarks time)")
    return ap


def finish(args):
    """The sizes --tiny stands for and the default dtype of the device."""
    if args.tiny:
        args.seq_len, args.batch, args.d_model, args.layers = 128, 2, 64, 1
        args.heads, args.kv_heads, args.head_dim, args.data_mb, args.val_batches = 2, 1, 32, 0.5, 1
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "f32"
    return args


def main():
    args = finish(parser().parse_args())
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("train_tiny: --device %s but torch sees no GPU (try --device cpu)" % args.device)
    os.makedirs(args.out, exist_ok=True)

    config = config_for(args)
    text = load_text(int(args.data_mb * 2**20))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    split = int(len(data) * 0.95)
    train_data, val_data = data[:split], data[split:]
    val = list(batches(val_data, args.val_batches, args.batch, args.seq_len, args.seed + 1, torch.device(args.device)))
    print("train_tiny: %.1f MB of stdlib source (%s), %d train / %d val bytes; nsa %s" % (
        len(data) / 2**20, os.path.dirname(os.__file__), len(train_data), len(val_data), nsa.version()))
    print("model: d=%d, %d layers, %d heads (%d kv), head_dim %d, T=%d, batch %d, %d steps on %s (%s)" % (
        args.d_model, args.layers, args.heads, args.kv_heads, args.head_dim, args.seq_len, args.batch, args.steps,
        args.device, args.dtype))
    print("nsa config: %s" % (config,))
    curves, info = {}, {}
    for kind in ("nsa", "full"):
        print("training %s attention" % kind, flush=True)
        curves[kind], secs, params, model = train(kind, args, train_data, val, config)
        info[kind] = (secs, params)
        if kind == "nsa" and args.save:
            torch.save({"args": vars(args), "state": model.state_dict()}, args.save)
            print("wrote %s" % args.save)

    print("\nloss curves (train = mean since the last row, val = held-out mean; nats per byte)")
    print("%6s  %10s %10s  %10s %10s" % ("step", "nsa train", "nsa val", "full train", "full val"))
    for a, b in zip(curves["nsa"], curves["full"]):
        print("%6d  %10.4f %10.4f  %10.4f %10.4f" % (a[0], a[1], a[2], b[1], b[2]))
    for kind in ("nsa", "full"):
        secs, params = info[kind]
        print("%-4s: %.2fM parameters, %.1f s, final val loss %.4f" % (kind, params / 1e6, secs, curves[kind][-1][2]))
    with open(os.path.join(args.out, "loss.csv"), "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["step", "nsa_train", "nsa_val", "full_train", "full_val"])
        for a, b in zip(curves["nsa"], curves["full"]):
            wr.writerow([a[0], a[1], a[2], b[1], b[2]])
    png = os.path.join(args.out, "loss.png")
    plot(curves, png, "tiny byte LM on stdlib source: NSA vs full attention (T=%d)" % args.seq_len)
    print("wrote %s and %s" % (png, os.path.join(args.out, "loss.csv")))


if __name__ == "__main__":
    main()
