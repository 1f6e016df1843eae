"""A stand-in for the two flash-attn calls that fla's NSA reference makes for its window branch
(fla.ops.nsa.naive: flash_attn_func, flash_attn_varlen_func), for GPU machines without
flash-attn. It computes the same function as written in flash-attn's documentation: causal
masking aligned to the bottom-right corner when the query and key lengths differ, window_size
(left, right) with -1 for unbounded, softmax_scale defaulting to 1/sqrt(head dim), grouped-query
heads by consecutive groups, and rows that see no key give 0. The arithmetic is float32 torch
with autograd, so fla's gradient checks have a reference too; the result is cast back to the
input dtype as flash-attn returns it.

tests/python/test_fla_suite.py puts this folder on the path only when the real flash_attn cannot
be imported, and says so in its summary: the window cases are then judged against this
transcription of flash-attn rather than flash-attn itself."""
import torch

__version__ = "0+sdpa-stand-in"


def _attend(q, k, v, softmax_scale, causal, window_size):
    """q [Tq, HQ, D], k [Tk, H, D], v [Tk, H, Dv] -> [Tq, HQ, Dv] in q's dtype."""
    Tq, HQ, D = q.shape
    Tk, H = k.shape[0], k.shape[1]
    g = HQ // H
    kk = k.repeat_interleave(g, dim=1).float()
    vv = v.repeat_interleave(g, dim=1).float()
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    i = torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq)  # each query's diagonal key
    j = torch.arange(Tk, device=q.device)[None, :]
    left, right = window_size
    vis = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        vis &= j <= i
    elif right >= 0:
        vis &= j <= i + right
    if left >= 0:
        vis &= j >= i - left
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1)
    p = torch.where(vis.any(-1, keepdim=True), p, torch.zeros_like(p))  # no key: 0, not NaN
    return torch.einsum("hqk,khd->qhd", p, vv).to(q.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **unused):
    """q [B, Tq, HQ, D], k, v [B, Tk, H, D] -> [B, Tq, HQ, Dv]."""
    if dropout_p:
        raise NotImplementedError("the flash-attn stand-in has no dropout")
    return torch.stack([_attend(q[b], k[b], v[b], softmax_scale, causal, window_size) for b in range(q.shape[0])])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), **unused):
    """Packed q [total_q, HQ, D], k, v [total_k, H, D] with int32 offsets -> [total_q, HQ, Dv]."""
    if dropout_p:
        raise NotImplementedError("the flash-attn stand-in has no dropout")
    cq, ck = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    outs = [_attend(q[cq[s]:cq[s + 1]], k[ck[s]:ck[s + 1]], v[ck[s]:ck[s + 1]], softmax_scale, causal, window_size)
            for s in range(len(cq) - 1)]
    return torch.cat(outs, 0)
