#!/usr/bin/env python3
"""Generate text with the tiny NSA language model of examples/train_tiny.py through KV caches.

The model is loaded from a checkpoint (train_tiny.py --save PATH) or trained here first. A batch
of prompts of different lengths (held-out standard-library source) is continued greedily twice:
  - cached: one prefill step over the prompts (per-sequence lengths), then one token per
    sequence per step through every layer's KV cache (NativeSparseAttention.forward(cache=...):
    nsa.step over contiguous or paged caches, phi of the compressed blocks as they complete);
  - recomputed: the whole sequence through the model again for every new token (no cache).
The greedy tokens of the two must be equal; both speeds are printed in tokens per second.

    PYTHONPATH=python python3 examples/generate.py --device cpu --tiny --train-steps 60
    PYTHONPATH=python python3 examples/train_tiny.py --save tiny.pt && \\
        PYTHONPATH=python python3 examples/generate.py --checkpoint tiny.pt --device cuda
"""
import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)
import nsa  # noqa: E402
import train_tiny  # noqa: E402


def load_or_train(opts, device):
    """(model, its train_tiny args): from opts.checkpoint, else trained for opts.train_steps."""
    if opts.checkpoint:
        ck = torch.load(opts.checkpoint, map_location="cpu")
        args = argparse.Namespace(**ck["args"])
        model = train_tiny.TinyLM("nsa", args, train_tiny.config_for(args))
        model.load_state_dict(ck["state"])
        return model.to(device), args
    argv = ["--device", opts.device, "--steps", str(opts.train_steps), "--eval-every", str(max(opts.train_steps, 1))]
    args = train_tiny.finish(train_tiny.parser().parse_args(argv + (["--tiny"] if opts.tiny else [])))
    args.dtype = "f32"  # (generation compares two float32 paths token for token)
    text = train_tiny.load_text(int(args.data_mb * 2**20))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    val = list(train_tiny.batches(data[int(len(data) * 0.95):], 1, args.batch, args.seq_len, args.seed + 1, device))
    print("training the tiny NSA model for %d steps on %s" % (args.steps, device), flush=True)
    _, secs, params, model = train_tiny.train("nsa", args, data[:int(len(data) * 0.95)], val, train_tiny.config_for(args))
    print("trained: %.2fM parameters in %.1f s" % (params / 1e6, secs))
    return model, args


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def generate_cached(model, prompts, new_tokens, page_size, device):
    """Greedy continuation of every prompt through the layers' KV caches: one prefill step (the
    prompts padded to the longest, q_lens their lengths), then one token per step."""
    B = len(prompts)
    lens = [len(p) for p in prompts]
    capacity = max(lens) + new_tokens
    caches = [blk.attn.new_cache(B, capacity, page_size=page_size) for blk in model.blocks]
    idx = torch.zeros(B, max(lens), dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        idx[b, :len(p)] = torch.tensor(p, device=device)
    sync(device)
    t0 = time.perf_counter()
    logits = model(idx, caches, lens)
    nxt = torch.stack([logits[b, lens[b] - 1].argmax() for b in range(B)])
    out = [[int(t)] for t in nxt.tolist()]
    for _ in range(new_tokens - 1):
        logits = model(nxt[:, None], caches)
        nxt = logits[:, -1].argmax(-1)
        for b, t in enumerate(nxt.tolist()):
            out[b].append(int(t))
    sync(device)
    return out, time.perf_counter() - t0


@torch.no_grad()
def generate_recomputed(model, prompts, new_tokens, device):
    """The same greedy continuation, each new token from the whole sequence again (no cache)."""
    out, t0 = [], time.perf_counter()
    for p in prompts:
        seq = torch.tensor(p, dtype=torch.long, device=device)[None]
        toks = []
        for _ in range(new_tokens):
            t = model(seq)[0, -1].argmax()
            toks.append(int(t))
            seq = torch.cat([seq, t.view(1, 1)], dim=1)
        out.append(toks)
    sync(device)
    return out, time.perf_counter() - t0


def show(b):
    return bytes(b).decode("utf-8", errors="replace").replace("\n", "\\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=None, help="a model saved by train_tiny.py --save (else train here)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--train-steps", type=int, default=300, help="steps when training here")
    ap.add_argument("--tiny", action="store_true", help="train_tiny's --tiny sizes when training here")
    ap.add_argument("--batch", type=int, default=4, help="prompts generated together")
    ap.add_argument("--prompt-len", type=int, default=100, help="longest prompt (the others shorter)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16, help="0: contiguous caches")
    opts = ap.parse_args()
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("generate: --device %s but torch sees no GPU (try --device cpu)" % opts.device)
    model, args = load_or_train(opts, device)
    model = model.float().eval()
    text = train_tiny.load_text(int(args.data_mb * 2**20))
    held = text[int(len(text) * 0.95):]
    lens = [max(1, opts.prompt_len - 17 * b) for b in range(opts.batch)]  # different lengths
    prompts = [list(held[1000 * b:1000 * b + n]) for b, n in enumerate(lens)]
    print("model: %d layers, d=%d, %d heads (%d kv); nsa %s; %s" % (args.layers, args.d_model, args.heads, args.kv_heads,
                                                                  nsa.version(), device))
    print("prompts: %d of lengths %s, %d new tokens each, %s caches" % (
        len(prompts), lens, opts.new_tokens, "paged (page %d)" % opts.page_size if opts.page_size else "contiguous"))
    generate_cached(model, [p[:8] for p in prompts], 2, opts.page_size or None, device)  # warm-up
    cached, t_cached = generate_cached(model, prompts, opts.new_tokens, opts.page_size or None, device)
    full, t_full = generate_recomputed(model, prompts, opts.new_tokens, device)
    n = len(prompts) * opts.new_tokens
    for b in range(len(prompts)):
        print("  [%d] ...%s|%s" % (b, show(prompts[b][-40:]), show(cached[b])))
    same = cached == full
    print("greedy tokens, cached vs recomputed: %s" % ("equal" if same else "DIFFERENT"))
    if not same:
        for b in range(len(prompts)):
            if cached[b] != full[b]:
                at = next(i for i, (x, y) in enumerate(zip(cached[b], full[b])) if x != y)
                print("  sequence %d first differs at new token %d" % (b, at))
    print("cached:     %8.1f tokens/s (%d tokens in %.3f s, prefill included)" % (n / t_cached, n, t_cached))
    print("recomputed: %8.1f tokens/s (%d tokens in %.3f s)" % (n / t_full, n, t_full))
    print("speed-up of the cache: %.1fx" % (t_full / t_cached))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
