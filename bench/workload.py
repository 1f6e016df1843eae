"""bench/workload.py -- a realistic input for the NSA benchmarks: what one attention layer of the
example model (examples/train_tiny.py, saved with --save) feeds its NSA call over T tokens of
held-out text -- q, k, v, the three gates and the layer's compressed keys and values -- written
to an .npz (float16, with the layer's nsa config) that bench/overlap.py --workload reads, and
that layer's neighbour overlap and query-tile unions (bench/overlap.py) beside random inputs' of
the same shapes.
Trained models let neighbouring queries choose mostly the same blocks; random inputs do not.

  PYTHONPATH=python python3 examples/train_tiny.py --seq-len 8192 --save tiny8k.pt   # on a GPU
  python3 bench/workload.py --checkpoint tiny8k.pt --T 65536 --layer 1 --out layer1-64k.npz
  python3 bench/workload.py --tiny --train-steps 5 --T 512 --device cpu --out w.npz  # a smoke run
  # the shapes the benchmarks time: the paper's NSA configuration, head dim 128, 16 query heads a kv head
  PYTHONPATH=python python3 examples/train_tiny.py --seq-len 8192 --batch 4 --nsa-config paper
      --head-dim 128 --heads 16 --kv-heads 1 --save paper8k.pt      # (one command)
  python3 bench/workload.py --checkpoint paper8k.pt --T 65536 --layer 1 --out paper-layer1-64k.npz
  python3 bench/peers.py --workload paper-layer1-64k.npz      # nsa and mdy666 on those inputs
"""
import argparse
import json
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(0, os.path.join(REPO, "examples"))
sys.path.insert(0, os.path.join(REPO, "bench"))


class Capture:
    """Records the inputs of the `layer`-th nsa.native_sparse_attention call (the model's layers
    call it in order) while in force; the call itself runs unchanged."""

    def __init__(self, nsa, layer):
        self.nsa, self.layer, self.calls, self.got = nsa, layer, 0, None

    def __enter__(self):
        self.orig = self.nsa.native_sparse_attention

        def spy(q, k, v, g_cmp, g_slc, g_swa, **kw):
            if self.calls == self.layer:
                self.got = dict(q=q, k=k, v=v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, k_cmp=kw.get("k_cmp"),
                                v_cmp=kw.get("v_cmp"), config=kw.get("config"))
            self.calls += 1
            return self.orig(q, k, v, g_cmp, g_slc, g_swa, **kw)
        self.nsa.native_sparse_attention = spy
        return self

    def __exit__(self, *exc):
        self.nsa.native_sparse_attention = self.orig


def held_out_tokens(train_tiny, args, T):
    """T bytes of the text the model did not train on (its last 5%), repeated if shorter."""
    text = train_tiny.load_text(int(args.data_mb * 2**20))
    held = np.frombuffer(text[int(len(text) * 0.95):], dtype=np.uint8)
    reps = -(-T // len(held))
    return np.tile(held, reps)[:T], reps > 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=None, help="a model saved by examples/train_tiny.py --save (else trained here)")
    ap.add_argument("--train-steps", type=int, default=300, help="steps when training here")
    ap.add_argument("--tiny", action="store_true", help="train_tiny's --tiny sizes when training here")
    ap.add_argument("--T", type=int, default=65536, help="tokens of held-out text the layer sees")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", required=True, help="the .npz to write (and <out>.json beside it)")
    opts = ap.parse_args(argv)
    import torch
    import nsa
    import generate
    import overlap
    import train_tiny
    opts.device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(opts.device)
    model, args = generate.load_or_train(opts, device)
    if opts.layer >= len(model.blocks):
        sys.exit("workload: --layer %d but the model has %d layers" % (opts.layer, len(model.blocks)))
    tokens, repeated = held_out_tokens(train_tiny, args, opts.T)
    idx = torch.from_numpy(tokens.astype(np.int64))[None].to(device)
    amp = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    model.eval()
    with torch.no_grad(), amp, Capture(nsa, opts.layer) as cap:
        model(idx)
    got = cap.got
    cfg = got["config"]
    arrays = {k: v.float().cpu().numpy().astype(np.float16) for k, v in got.items() if k != "config" and v is not None}
    arrays["config"] = np.array([cfg.cmp_len, cfg.cmp_stride, cfg.slc_block, cfg.slc_topk, cfg.n_init, cfg.n_local,
                                 cfg.window], np.int64)
    np.savez(opts.out, **arrays)
    q = arrays["q"]
    sel = overlap.selection(overlap.to_device(q, "cpu"), None, cfg, overlap.to_device(arrays["k_cmp"], "cpu"))
    ours, pairs = overlap.neighbour_jaccard(sel)
    rq, rk = overlap.random_qk(*q.shape[:3], arrays["k"].shape[2], q.shape[3], "cpu", 0)
    rsel = overlap.selection(rq, rk, cfg)
    rand, _ = overlap.neighbour_jaccard(rsel)
    meta = {"checkpoint": os.path.basename(opts.checkpoint) if opts.checkpoint else None,
            "trained_here_steps": None if opts.checkpoint else opts.train_steps, "layer": opts.layer, "T": opts.T,
            "text_repeated": bool(repeated), "shapes": {k: list(v.shape) for k, v in arrays.items()},
            "config": arrays["config"].tolist(), "neighbour_overlap": ours, "pairs": pairs,
            "neighbour_overlap_random": rand, "tiles": overlap.tile_figures(sel),
            "tiles_random": overlap.tile_figures(rsel), "model": {k: getattr(args, k) for k in ("d_model", "layers", "heads",
                                                                                      "kv_heads", "head_dim", "seq_len")}}
    with open(os.path.splitext(opts.out)[0] + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    print("wrote %s: layer %d of %d, T %d, q %s, k %s; neighbour overlap %.4f (random inputs of the same shapes %.4f)"
          % (opts.out, opts.layer, len(model.blocks), opts.T, tuple(q.shape), tuple(arrays["k"].shape), ours, rand))
    return 0


if __name__ == "__main__":
    sys.exit(main())
