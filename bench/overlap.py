"""bench/overlap.py -- how much neighbouring queries share their selected blocks: the mean Jaccard
index |S_t & S_t+1| / |S_t | S_t+1| of the top-n block sets of positions t and t + 1 (per batch
entry and kv head, over the t where both sets are non-empty), for random q, k or for q, k saved
from a model (an .npz with q [B, T, HQ, D] and k [B, T, H, D], optionally the layer's k_cmp and
its config, as bench/workload.py writes it). A selected-attention kernel that
loads a block once for the neighbouring queries that chose it pays off as this grows; random
inputs are its worst case.

What such a kernel would move and compute is measured too (--tiles): for query tiles of P
consecutive positions (per batch entry and kv head), the union U of their selected sets against
the sum of the set sizes. A union tile loads each of U blocks once for its P positions (bytes
ratio U / sum |S_t| against loading every position's set), but multiplies all P positions with
every block of U under a membership mask (products ratio P U / sum |S_t|). The selected branch
is bound by its bytes on an H100 / H200 (about 6x its products' time at the paper's
configuration), so a union tile pays while its bytes ratio falls by more than its products
ratio leaves room for.

  python3 bench/overlap.py --T 4096                  # random q, k, the paper's configuration
  python3 bench/overlap.py --workload layer.npz      # q, k saved from an attention layer
  python3 bench/overlap.py --device cuda --T 65536   # torch on a GPU
  python3 bench/overlap.py --self-test               # the metric on hand-made sets, no selection
"""
import argparse
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "python"))

PAPER = dict(cmp_len=32, cmp_stride=16, slc_block=64, slc_topk=16, n_init=1, n_local=2, window=512)


def neighbour_jaccard(idx):
    """idx [B, T, H, n] integer block ids, -1 padded, each row's ids distinct. Returns (mean
    Jaccard index of positions t and t + 1 over (b, t, h) where both sets are non-empty, count)."""
    idx = np.asarray(idx)
    if idx.ndim != 4:
        raise ValueError("block indices must be [B, T, H, n], got shape %s" % (idx.shape,))
    a, b = idx[:, :-1], idx[:, 1:]
    if a.shape[1] == 0:
        return float("nan"), 0
    inter = ((a[..., :, None] == b[..., None, :]) & (a[..., :, None] >= 0)).any(-1).sum(-1)
    na, nb = (a >= 0).sum(-1), (b >= 0).sum(-1)
    both = (na > 0) & (nb > 0)
    j = inter[both] / (na + nb - inter)[both]
    return (float(j.mean()), int(j.size)) if j.size else (float("nan"), 0)


def tile_unions(idx, P):
    """idx [B, T, H, n] as above; query tiles of P consecutive positions (a last partial tile
    included). Returns (sum over tiles of the union size, sum of the set sizes, tiles,
    positions, products): the blocks a union tile loads against those its positions load each
    for itself, the (batch entry, position, kv head) rows, and the (row, block) products a union
    tile runs (each of its positions with every block of its union)."""
    idx = np.asarray(idx)
    if idx.ndim != 4:
        raise ValueError("block indices must be [B, T, H, n], got shape %s" % (idx.shape,))
    if P < 1:
        raise ValueError("tile positions must be >= 1, got %d" % P)
    B, T, H, n = idx.shape
    if T == 0:
        return 0, 0, 0, 0, 0
    pad = (-T) % P
    if pad:
        idx = np.concatenate([idx, np.full((B, pad, H, n), -1, idx.dtype)], axis=1)
    tiles = np.sort(idx.reshape(B, -1, P, H, n).transpose(0, 1, 3, 2, 4).reshape(B, -1, H, P * n), axis=-1)
    fresh = np.ones(tiles.shape, bool)
    fresh[..., 1:] = tiles[..., 1:] != tiles[..., :-1]
    per_tile = ((tiles >= 0) & fresh).sum(-1)  # [B, tiles, H]
    real = np.full(per_tile.shape[1], P)
    real[-1] = T - (per_tile.shape[1] - 1) * P  # the last tile's positions
    products = int((per_tile * real[None, :, None]).sum())
    return int(per_tile.sum()), int((idx >= 0).sum()), B * per_tile.shape[1] * H, B * T * H, products


def tile_figures(idx, sizes=(8, 16)):
    """{P: the union tile's figures} for query tiles of each size P (tile_unions): mean union
    and set sizes in blocks, its bytes and products against loading each position's set."""
    out = {}
    for P in sizes:
        union, loads, ntiles, positions, products = tile_unions(idx, P)
        if loads:
            out[P] = dict(union_per_tile=union / ntiles, set_per_position=loads / positions, bytes_ratio=union / loads,
                          products_ratio=products / loads)
    return out


def selection(q, k, config, k_cmp=None):
    """NSA's selection (nsa.select) over the compressed keys k_cmp, or over k mean-pooled when
    none are given, as numpy [B, T, H, n]."""
    import nsa
    idx = nsa.select(q, k_cmp if k_cmp is not None else nsa.compress(k, config), config)
    return idx.cpu().numpy() if hasattr(idx, "cpu") else np.asarray(idx)


def config_of(data, nsa):
    """The nsa.Config an .npz records (its 'config' array: cmp_len, cmp_stride, slc_block,
    slc_topk, n_init, n_local, window), else the paper's."""
    if "config" not in data:
        return nsa.Config(**PAPER)
    return nsa.Config(*(int(x) for x in np.asarray(data["config"])[:7]))


def random_qk(B, T, HQ, H, D, device, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, HQ, D)).astype(np.float32)
    k = rng.standard_normal((B, T, H, D)).astype(np.float32)
    return to_device(q, device), to_device(k, device)


def to_device(x, device):
    if device == "cpu":
        return np.ascontiguousarray(x, dtype=np.float32)
    import torch
    return torch.from_numpy(np.asarray(x, dtype=np.float32)).to(device, torch.bfloat16)


def self_test():
    fails = 0

    def check(cond, what):
        nonlocal fails
        if not cond:
            fails += 1
            print("FAIL:", what)
    same = np.array([[[[0, 1, 2]], [[0, 1, 2]]]])
    check(neighbour_jaccard(same) == (1.0, 1), "identical sets: 1")
    apart = np.array([[[[0, 1, -1]], [[2, 3, -1]]]])
    check(neighbour_jaccard(apart) == (0.0, 1), "disjoint sets: 0")
    half = np.array([[[[0, 1, 2, 3]], [[2, 3, 4, 5]]]])
    check(abs(neighbour_jaccard(half)[0] - 2 / 6) < 1e-12, "two shared of six: 1/3")
    empty = np.array([[[[-1, -1]], [[0, 1]], [[0, 5]]]])
    m, n = neighbour_jaccard(empty)
    check(n == 1 and abs(m - 1 / 3) < 1e-12, "a position without blocks is left out")
    two_heads = np.array([[[[0, 1], [4, -1]], [[0, 1], [5, -1]]]])
    check(neighbour_jaccard(two_heads) == (0.5, 2), "heads averaged: (1 + 0) / 2")
    check(neighbour_jaccard(np.zeros((1, 1, 1, 2), np.int32))[1] == 0, "one position: no pair")
    # tile unions: three positions [0 1 2] [2 3 -1] [2 3 4] in tiles of 2: {0 1 2 3} and {2 3 4}
    # (the last tile holds one position: its products are 1 x 3)
    t3 = np.array([[[[0, 1, 2]], [[2, 3, -1]], [[2, 3, 4]]]])
    check(tile_unions(t3, 2) == (7, 8, 2, 3, 2 * 4 + 1 * 3), "unions 4 + 3 of sets 3 + 2 + 3 in two tiles")
    check(tile_unions(t3, 1) == (8, 8, 3, 3, 8), "tiles of one position: the sets themselves")
    check(tile_unions(same, 2) == (3, 6, 1, 2, 6), "identical sets: loaded once")
    two = np.array([[[[0, 1], [0, -1]], [[1, 2], [0, 1]]]])
    check(tile_unions(two, 2) == (5, 7, 2, 4, 10), "kv heads apart: {0 1 2} and {0 1}")
    odd = tile_figures(np.array([[[[0, 1]], [[0, 1]], [[0, 1]]]]), (2,))[2]
    check(odd["set_per_position"] == 2.0 and odd["products_ratio"] == 1.0, "a partial last tile: its real positions only")
    print("%d passed, %d failed" % (11 - fails, fails))
    return 1 if fails else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=4096, help="tokens of the random inputs")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", default="64/4", help="HQ/H of the random inputs")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--workload", default=None, help=".npz with q [B, T, HQ, D] and k [B, T, H, D] instead")
    ap.add_argument("--device", default="cpu", help="cpu (numpy) or a torch device")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiles", default="8,16", help="query-tile sizes P for the union figures ('' for none)")
    ap.add_argument("--json", default=None, help="also write the figures to this .json")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    import nsa
    config, k_cmp = nsa.Config(**PAPER), None
    if args.workload:
        data = np.load(args.workload)
        q, k = to_device(data["q"], args.device), to_device(data["k"], args.device)
        config = config_of(data, nsa)
        if "k_cmp" in data:  # the layer's own (learned) compressed keys
            k_cmp = to_device(data["k_cmp"], args.device)
        what = "workload %s" % os.path.basename(args.workload)
    else:
        HQ, H = (int(x) for x in args.heads.split("/"))
        q, k = random_qk(args.batch, args.T, HQ, H, args.dim, args.device, args.seed)
        what = "random q, k"
    B, T, HQ, D = q.shape
    H = k.shape[2]
    idx = selection(q, k, config, k_cmp)
    mean, count = neighbour_jaccard(idx)
    print("%s: B %d, T %d, HQ %d, H %d, D %d, top-%d of %d-token blocks: neighbour overlap (mean Jaccard) %.4f over %d pairs"
          % (what, B, T, HQ, H, D, config.slc_topk, config.slc_block, mean, count))
    out = dict(what=what, B=B, T=T, HQ=HQ, H=H, D=D, slc_topk=config.slc_topk, slc_block=config.slc_block,
               neighbour_overlap=mean, pairs=count, tiles={})
    out["tiles"] = tile_figures(idx, [int(x) for x in args.tiles.split(",") if x.strip()])
    for P, t in out["tiles"].items():
        print("  query tiles of %2d positions: union %.1f blocks against %.1f a position; bytes x%.3f, products x%.2f"
              " of loading each position's set" % (P, t["union_per_tile"], t["set_per_position"], t["bytes_ratio"],
                                                   t["products_ratio"]))
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
