"""Naive NSA written from spec/nsa.md alone, for the Python tests: numpy in any float dtype
(float64 is the reference, float32 the "straightforward same-precision implementation" of
the tolerance rule), with a hand-written backward, and the same forward in torch (autograd
gives its backward). Dense masks per branch; slow on purpose; tiny shapes only."""
import math

import numpy as np


class Cfg:
    def __init__(self, cmp_len=32, cmp_stride=16, slc_block=64, slc_topk=16, n_init=1, n_local=2, window=512,
                 scale=0.0, swa_scale=0.0):
        self.cmp_len, self.cmp_stride, self.slc_block = cmp_len, cmp_stride, slc_block
        self.slc_topk, self.n_init, self.n_local, self.window, self.scale = slc_topk, n_init, n_local, window, scale
        self.swa_scale = swa_scale  # the window branch's scale; 0 = scale

    @classmethod
    def of(cls, config):
        return cls(**{f: getattr(config, f) for f in ("cmp_len", "cmp_stride", "slc_block", "slc_topk", "n_init",
                                                        "n_local", "window", "scale", "swa_scale")})


def sequences(B, T, cu_seqlens):
    """(b, start, end) of every sequence: dense rows, or the packed ones of cu_seqlens (B == 1)."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(x) for x in cu_seqlens]
    return [(0, cu[s], cu[s + 1]) for s in range(len(cu) - 1)]


def num_cmp(T, l, d):
    return (T - l) // d + 1 if T >= l else 0


def cmp_row_offsets(B, T, cu_seqlens, cfg):
    """First compressed row of each sequence in k_cmp's dim 1 (per batch row when dense)."""
    offs, acc = [], 0
    for b, s, e in sequences(B, T, cu_seqlens):
        if cu_seqlens is None:
            offs.append(0)
        else:
            offs.append(acc)
            acc += num_cmp(e - s, cfg.cmp_len, cfg.cmp_stride)
    return offs


# ---- masks and matrices of the spec (per sequence of length T) -----------------------------------

def pool_matrix(T, l, d):
    """[Nc, T]: compressed block i = mean of tokens [i*d, i*d + l) (spec 1)."""
    nc = num_cmp(T, l, d)
    P = np.zeros((nc, T))
    for i in range(nc):
        P[i, i * d:i * d + l] = 1.0 / l
    return P


def cmp_mask(T, l, d):
    """[1, T, Nc]: query t sees block i iff i*d + l - 1 <= t (spec 2)."""
    nc = num_cmp(T, l, d)
    t = np.arange(T)[:, None]
    i = np.arange(nc)[None, :]
    return (i * d + l - 1 <= t)[None]


def overlap_matrix(nc, nb, l, d, lp):
    """[Nc, nb]: tokens shared by compressed block i and selection block j."""
    ov = np.zeros((nc, nb))
    for i in range(nc):
        for j in range(nb):
            lo, hi = max(i * d, j * lp), min(i * d + l, (j + 1) * lp)
            ov[i, j] = max(hi - lo, 0)
    return ov


def select_blocks(p_cmp, T, H, cfg):
    """Spec 3. p_cmp [HQ, T, Nc] -> (indices [T, H, n] ascending, -1 padded; importance [H, T, nb])."""
    l, d, lp, n = cfg.cmp_len, cfg.cmp_stride, cfg.slc_block, cfg.slc_topk
    HQ, nc = p_cmp.shape[0], p_cmp.shape[2]
    nb = -(-T // lp)
    p_slc = np.einsum("htc,cj->htj", p_cmp.astype(np.float64), overlap_matrix(nc, nb, l, d, lp)) / d
    imp = p_slc.reshape(H, HQ // H, T, nb).sum(1)
    idx = np.full((T, H, n), -1, dtype=np.int32)
    for t in range(T):
        cur = t // lp
        for h in range(H):
            def rank(j):
                forced = j < cfg.n_init or j > cur - cfg.n_local
                return (not forced, -imp[h, t, j], j)
            keep = sorted(sorted(range(cur + 1), key=rank)[:n])
            idx[t, h, :len(keep)] = keep
    return idx, imp


def slc_mask(idx, counts, T, lp):
    """[H, T, T]: query t sees the keys <= t of its selected blocks (spec 4); -1 and
    out-of-range entries skipped, duplicates once, only the first counts[t, h] entries."""
    H, m = idx.shape[1], idx.shape[2]
    nb = -(-T // lp)
    mask = np.zeros((H, T, T), dtype=bool)
    for t in range(T):
        for h in range(H):
            c = m if counts is None else min(max(int(counts[t, h]), 0), m)
            for j in idx[t, h, :c]:
                if 0 <= j < nb:
                    mask[h, t, j * lp:min((j + 1) * lp, t + 1)] = True
    return mask


def swa_mask(T, w):
    """[1, T, T]: keys in [t - w + 1, t] (spec 5)."""
    t = np.arange(T)[:, None]
    s = np.arange(T)[None, :]
    return ((s <= t) & (s >= t - w + 1))[None]


# ---- attention on a mask, forward and backward ----------------------------------------------------

def attn_fwd(q, k, v, mask, scale):
    """q [T, HQ, DK], k [S, H, DK], v [S, H, DV], mask broadcastable to [HQ, T, S] (a kv-head
    mask [H, T, S] is expanded per group). Returns o [T, HQ, DV], lse [T, HQ], P [HQ, T, S]."""
    T, HQ, _ = q.shape
    S, H, DV = v.shape
    G = HQ // H
    dt = q.dtype
    if mask.shape[0] == H and H != HQ:
        mask = np.repeat(mask, G, axis=0)
    if S == 0:
        return np.zeros((T, HQ, DV), dt), np.full((T, HQ), -np.inf), np.zeros((HQ, T, 0), dt)
    kk, vv = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = dt.type(scale) * np.einsum("thd,shd->hts", q, kk)
    m = np.broadcast_to(mask, s.shape)
    s = np.where(m, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0).astype(dt)
    e = np.where(m, np.exp(s - mx), 0).astype(dt)
    z = e.sum(-1, keepdims=True)
    P = np.where(z > 0, e / np.where(z > 0, z, 1), 0).astype(dt)
    with np.errstate(divide="ignore"):
        lse = np.where(z[..., 0] > 0, mx[..., 0] + np.log(np.where(z[..., 0] > 0, z[..., 0], 1)), -np.inf)
    o = np.einsum("hts,shd->thd", P, vv).astype(dt)
    return o, lse.T, P


def attn_bwd(q, k, v, P, o, do, scale):
    """Gradients of attn_fwd: dq [T, HQ, DK], dk [S, H, DK], dv [S, H, DV]."""
    T, HQ, DK = q.shape
    S, H, DV = v.shape
    G = HQ // H
    kk, vv = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    dP = np.einsum("thd,shd->hts", do, vv)
    D = (do * o).sum(-1).T[..., None]
    dS = P * (dP - D)
    dq = scale * np.einsum("hts,shd->thd", dS, kk)
    dkk = scale * np.einsum("hts,thd->shd", dS, q)
    dvv = np.einsum("hts,thd->shd", P, do)
    return dq, dkk.reshape(S, H, G, DK).sum(2), dvv.reshape(S, H, G, DV).sum(2)


# ---- the whole NSA -----------------------------------------------------------------------------

def nsa(q, k, v, g_cmp=None, g_slc=None, g_swa=None, cfg=None, k_cmp=None, v_cmp=None, block_indices=None,
        block_counts=None, cu_seqlens=None, k_slc=None, v_slc=None, k_swa=None, v_swa=None, dtype=np.float64):
    """Forward of spec sections 1-6 in `dtype`. Returns a dict: o, o_cmp/o_slc/o_swa, lse_*,
    block_indices (computed; -1 padded), importance (per sequence), and backward(dout) -> dict of
    gradients (q, k, v, g_*, and k_cmp/v_cmp, k_slc/..., when given)."""
    cfg = cfg or Cfg()
    cast = lambda x: None if x is None else np.asarray(x).astype(dtype)  # noqa: E731
    q, k, v = cast(q), cast(k), cast(v)
    g = {"cmp": cast(g_cmp), "slc": cast(g_slc), "swa": cast(g_swa)}
    kc_in, vc_in = cast(k_cmp), cast(v_cmp)
    kv_slc = (cast(k_slc), cast(v_slc)) if k_slc is not None else None
    kv_swa = (cast(k_swa), cast(v_swa)) if k_swa is not None else None
    B, T, HQ, DK = q.shape
    H, DV = k.shape[2], v.shape[3]
    scale = cfg.scale if cfg.scale else 1.0 / math.sqrt(DK)
    scale_swa = cfg.swa_scale if cfg.swa_scale else scale
    l, d, lp, n = cfg.cmp_len, cfg.cmp_stride, cfg.slc_block, cfg.slc_topk
    res = {"o": np.zeros((B, T, HQ, DV), dtype)}
    for br in ("cmp", "slc", "swa"):
        if g[br] is not None:
            res["o_" + br] = np.zeros((B, T, HQ, DV), dtype)
            res["lse_" + br] = np.full((B, T, HQ), -np.inf)
    res["block_indices"] = np.full((B, T, H, n), -1, dtype=np.int32)
    res["importance"] = []
    tapes = []
    offs = cmp_row_offsets(B, T, cu_seqlens, cfg)
    for (b, s, e), off in zip(sequences(B, T, cu_seqlens), offs):
        L = e - s
        qs, ks, vs = q[b, s:e], k[b, s:e], v[b, s:e]
        nc = num_cmp(L, l, d)
        pool = pool_matrix(L, l, d).astype(dtype)
        if kc_in is not None:
            kc, vc = kc_in[b, off:off + nc], vc_in[b, off:off + nc]
        else:
            kc, vc = np.einsum("ct,thd->chd", pool, ks), np.einsum("ct,thd->chd", pool, vs)
        tape = {"b": b, "s": s, "e": e, "off": off, "nc": nc, "pool": pool, "kc": kc, "vc": vc}
        oc, lc, Pc = attn_fwd(qs, kc, vc, cmp_mask(L, l, d), scale)
        tape["cmp"] = (qs, kc, vc, Pc, oc)
        lses = {"cmp": lc}
        if g["slc"] is not None:
            if block_indices is None:
                idx, imp = select_blocks(Pc, L, H, cfg)
                res["block_indices"][b, s:e] = idx
                res["importance"].append(imp)
                counts = None
            else:
                idx = np.asarray(block_indices)[b, s:e]
                counts = None if block_counts is None else np.asarray(block_counts)[b, s:e]
            ksl, vsl = (kv_slc[0][b, s:e], kv_slc[1][b, s:e]) if kv_slc else (ks, vs)
            o_b, lses["slc"], P_b = attn_fwd(qs, ksl, vsl, slc_mask(idx, counts, L, lp), scale)
            tape["slc"] = (qs, ksl, vsl, P_b, o_b)
        if g["swa"] is not None:
            ksw, vsw = (kv_swa[0][b, s:e], kv_swa[1][b, s:e]) if kv_swa else (ks, vs)
            o_b, lses["swa"], P_b = attn_fwd(qs, ksw, vsw, swa_mask(L, cfg.window), scale_swa)
            tape["swa"] = (qs, ksw, vsw, P_b, o_b)
        for br in ("cmp", "slc", "swa"):
            if g[br] is None:
                continue
            o_b = tape[br][4]
            res["o_" + br][b, s:e] = o_b
            res["lse_" + br][b, s:e] = lses[br]
            res["o"][b, s:e] += g[br][b, s:e][..., None] * o_b
        tapes.append(tape)

    def backward(dout):
        dout = cast(dout)
        gr = {"q": np.zeros_like(q), "k": np.zeros_like(k), "v": np.zeros_like(v)}
        for br in ("cmp", "slc", "swa"):
            if g[br] is not None:
                gr["g_" + br] = np.zeros_like(g[br])
        if kc_in is not None:
            gr["k_cmp"], gr["v_cmp"] = np.zeros_like(kc_in), np.zeros_like(vc_in)
        if kv_slc:
            gr["k_slc"], gr["v_slc"] = np.zeros_like(kv_slc[0]), np.zeros_like(kv_slc[1])
        if kv_swa:
            gr["k_swa"], gr["v_swa"] = np.zeros_like(kv_swa[0]), np.zeros_like(kv_swa[1])
        for tp in tapes:
            b, s, e = tp["b"], tp["s"], tp["e"]
            do_all = dout[b, s:e]
            for br in ("cmp", "slc", "swa"):
                if g[br] is None:
                    continue
                qb, kb, vb, Pb, ob = tp[br]
                gb = g[br][b, s:e]
                gr["g_" + br][b, s:e] = (do_all * ob).sum(-1)
                dq, dk, dv = attn_bwd(qb, kb, vb, Pb, ob, gb[..., None] * do_all, scale_swa if br == "swa" else scale)
                gr["q"][b, s:e] += dq
                if br == "cmp":
                    if kc_in is not None:
                        off, nc = tp["off"], tp["nc"]
                        gr["k_cmp"][b, off:off + nc] += dk
                        gr["v_cmp"][b, off:off + nc] += dv
                    else:
                        gr["k"][b, s:e] += np.einsum("ct,chd->thd", tp["pool"], dk)
                        gr["v"][b, s:e] += np.einsum("ct,chd->thd", tp["pool"], dv)
                elif (br == "slc" and kv_slc) or (br == "swa" and kv_swa):
                    gr["k_" + br][b, s:e] += dk
                    gr["v_" + br][b, s:e] += dv
                else:
                    gr["k"][b, s:e] += dk
                    gr["v"][b, s:e] += dv
        return gr

    res["backward"] = backward
    return res


def fla_nsa(q, k, v, g_cmp=None, g_slc=None, g_swa=None, block_indices=None, block_counts=16, block_size=64,
            window_size=0, scale=None, cu_seqlens=None, dtype=np.float64):
    """fla's parallel_nsa written out on the spec: l = d = l' = block_size, n = block_counts,
    forced 0, cur-1, cur; g_cmp None skips the compressed branch; the selected branch is always
    on (gate 1 without g_slc); the window branch iff window_size > 0. int block_counts only."""
    B, T, HQ = q.shape[:3]
    # fla's window branch is flash-attn at its default scale K**-0.5, whatever `scale` is
    cfg = Cfg(block_size, block_size, block_size, block_counts, 1, 2, max(window_size, 1), scale or 0.0,
              q.shape[-1] ** -0.5)
    if g_slc is None:
        g_slc = np.ones((B, T, HQ))
    return nsa(q, k, v, g_cmp, g_slc, g_swa if window_size > 0 else None, cfg, block_indices=block_indices,
               cu_seqlens=cu_seqlens, dtype=dtype)


# ---- the same forward in torch (autograd gives the backward) ---------------------------------------

def torch_nsa(q, k, v, g_cmp, g_slc, g_swa, cfg, block_indices, block_counts=None, k_cmp=None, v_cmp=None,
              cu_seqlens=None):
    """Naive torch forward in q's dtype on q's device with the given selection (block_indices
    [B, T, H, m] numpy/tensor, the library's or the reference's). Softmax in float32 when q is
    half precision, as a plain PyTorch implementation would do it."""
    import torch
    B, T, HQ, DK = q.shape
    H, DV = k.shape[2], v.shape[3]
    G = HQ // H
    scale = cfg.scale if cfg.scale else 1.0 / math.sqrt(DK)
    scale_swa = cfg.swa_scale if cfg.swa_scale else scale
    l, d, lp = cfg.cmp_len, cfg.cmp_stride, cfg.slc_block
    idx = None if block_indices is None else np.asarray(
        block_indices.cpu() if hasattr(block_indices, "cpu") else block_indices)
    cnt = None if block_counts is None else np.asarray(
        block_counts.cpu() if hasattr(block_counts, "cpu") else block_counts)
    dev = q.device

    def attn(qs, ks, vs, mask, scale=scale):
        if ks.shape[0] == 0:
            return qs.new_zeros((qs.shape[0], HQ, DV))
        kk, vv = ks.repeat_interleave(G, dim=1), vs.repeat_interleave(G, dim=1)
        s = torch.einsum("thd,shd->hts", qs, kk)
        if s.dtype in (torch.float16, torch.bfloat16):
            s = s.float()
        s = s * scale
        m = torch.as_tensor(np.array(np.broadcast_to(mask, s.shape)), device=dev)
        s = s.masked_fill(~m, torch.finfo(s.dtype).min)
        p = torch.softmax(s, -1) * m  # rows without a key: o = 0 (and no NaN anywhere)
        return torch.einsum("hts,shd->thd", p.to(qs.dtype), vv)

    rows = []
    offs = cmp_row_offsets(B, T, cu_seqlens, cfg)
    for (b, s, e), off in zip(sequences(B, T, cu_seqlens), offs):
        L = e - s
        qs, ks, vs = q[b, s:e], k[b, s:e], v[b, s:e]
        nc = num_cmp(L, l, d)
        out = qs.new_zeros((L, HQ, DV))
        if g_cmp is not None:
            if k_cmp is not None:
                kc, vc = k_cmp[b, off:off + nc], v_cmp[b, off:off + nc]
            else:
                pool = torch.as_tensor(pool_matrix(L, l, d), dtype=q.dtype, device=dev)
                kc, vc = torch.einsum("ct,thd->chd", pool, ks), torch.einsum("ct,thd->chd", pool, vs)
            out = out + g_cmp[b, s:e, :, None] * attn(qs, kc, vc, cmp_mask(L, l, d))
        if g_slc is not None:
            m = slc_mask(idx[b, s:e], None if cnt is None else cnt[b, s:e], L, lp)
            m = np.repeat(m, G, axis=0)
            out = out + g_slc[b, s:e, :, None] * attn(qs, ks, vs, m)
        if g_swa is not None:
            out = out + g_swa[b, s:e, :, None] * attn(qs, ks, vs, swa_mask(L, cfg.window), scale_swa)
        rows.append((b, out))
    per_b = [[o for bb, o in rows if bb == b] for b in range(B)]
    return torch.stack([torch.cat(x, 0) if x else q.new_zeros((0, HQ, DV)) for x in per_b], 0)
