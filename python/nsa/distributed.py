"""nsa.distributed -- context parallelism: NSA over sequences split across the ranks of a
torch.distributed process group (NCCL on GPUs, gloo on the CPU), with autograd.

Layout (zigzag): the T positions of the sequences are cut into 2P chunks for P ranks, chunk c
holding positions [bounds[c], bounds[c + 1]) with bounds[c] = c * T // (2P); rank r holds
chunks r and 2P - 1 - r, in that order, along dim 1 of every per-position tensor (q, k, v, the
gates, the output). Pairing an early chunk with a late one evens out the causal cost, which
grows with the position in the compressed branch. `shard` cuts a whole tensor into a rank's
part, `gather` rebuilds the whole tensor from every rank's part, `positions` gives the
positions of a rank's rows (for rotary embeddings).

One call, on every rank of the group:
  forward: K and V are all-gathered (every query reads keys from the start of its sequence:
    the compressed blocks, the selected blocks, the window); each of the rank's two chunks runs
    the library's query-chunk NSA (queries of the chunk against keys [0, end of the chunk),
    nsa.h "Query chunks") -- compression, selection, the three branches and the gates, exactly
    the rows of the whole-sequence call;
  backward: the chunks' query-side gradients (q, gates) stay local; the key-side gradients of
    both chunks (dk, dv: every position up to the chunk's end) are added, exchanged with one
    all-to-all, and each rank sums the pieces of its own rows in rank order, so the result is
    deterministic for a fixed P.
Every rank holds B whole batch entries' chunks; varlen packing (cu_seqlens) is not supported
here. Outputs, the selection and every gradient equal the single-process call's up to the
order of floating-point sums in dk / dv.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _core

__all__ = ["zigzag_bounds", "local_length", "positions", "shard", "gather", "native_sparse_attention"]


def _world(group) -> Tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def zigzag_bounds(seq_len: int, world_size: int) -> List[int]:
    """The 2P + 1 chunk boundaries: chunk c is positions [b[c], b[c + 1]); b[c] = c * T // (2P)."""
    if world_size < 1:
        raise ValueError("world_size must be >= 1, got %d" % world_size)
    if seq_len < 0:
        raise ValueError("seq_len must be >= 0, got %d" % seq_len)
    return [c * seq_len // (2 * world_size) for c in range(2 * world_size + 1)]


def _chunks(rank: int, world_size: int) -> Tuple[int, int]:
    return rank, 2 * world_size - 1 - rank


def local_length(seq_len: int, rank: int, world_size: int) -> int:
    """Rows of rank `rank`'s part: the lengths of its two chunks."""
    b = zigzag_bounds(seq_len, world_size)
    c0, c1 = _chunks(rank, world_size)
    return (b[c0 + 1] - b[c0]) + (b[c1 + 1] - b[c1])


def positions(seq_len: int, rank: int, world_size: int, device=None) -> Tensor:
    """Positions [local_length] of rank `rank`'s rows in the sequence (int64)."""
    b = zigzag_bounds(seq_len, world_size)
    c0, c1 = _chunks(rank, world_size)
    return torch.cat([torch.arange(b[c0], b[c0 + 1], device=device), torch.arange(b[c1], b[c1 + 1], device=device)])


def shard(x: Tensor, rank: int, world_size: int, dim: int = 1) -> Tensor:
    """Rank `rank`'s part of a whole tensor (dim `dim` = the T positions): its two chunks."""
    b = zigzag_bounds(x.shape[dim], world_size)
    c0, c1 = _chunks(rank, world_size)
    return torch.cat([x.narrow(dim, b[c0], b[c0 + 1] - b[c0]), x.narrow(dim, b[c1], b[c1 + 1] - b[c1])], dim=dim)


def _padded(x: Tensor, seq_len: int, world: int) -> Tensor:
    """x [B, n, ...] with zero rows appended up to the longest rank's part, contiguous: the equal
    sizes the collectives move."""
    pad = max(local_length(seq_len, r, world) for r in range(world)) - x.shape[1]
    return torch.cat([x, x.new_zeros((x.shape[0], pad) + tuple(x.shape[2:]))], dim=1) if pad else x.contiguous()


def _gather_parts(x: Tensor, seq_len: int, group) -> List[Tensor]:
    """Every rank's part (all-gather of the padded parts)."""
    world, _ = _world(group)
    xp = _padded(x, seq_len, world)
    parts = [torch.empty_like(xp) for _ in range(world)]
    dist.all_gather(parts, xp, group=group)
    return [parts[r][:, :local_length(seq_len, r, world)] for r in range(world)]


def _assemble(parts: Sequence[Tensor], seq_len: int) -> Tensor:
    """The whole tensor (dim 1 = positions) from every rank's part."""
    world = len(parts)
    b = zigzag_bounds(seq_len, world)
    pieces = [None] * (2 * world)
    for r, part in enumerate(parts):
        c0, c1 = _chunks(r, world)
        n0 = b[c0 + 1] - b[c0]
        pieces[c0], pieces[c1] = part[:, :n0], part[:, n0:]
    return torch.cat(pieces, dim=1)


def gather(x: Tensor, seq_len: int, group=None) -> Tensor:
    """The whole tensor [B, T, ...] from every rank's part [B, local_length, ...] (no gradient)."""
    _check_part(x, "x", seq_len, group)
    return _assemble(_gather_parts(x.detach(), seq_len, group), seq_len)


def _check_part(x: Optional[Tensor], name: str, seq_len: int, group):
    if x is None:
        return
    world, rank = _world(group)
    want = local_length(seq_len, rank, world)
    if x.dim() < 2 or x.shape[1] != want:
        raise ValueError("%s: dim 1 must be this rank's %d positions of seq_len %d (rank %d of %d), got shape %s"
                         % (name, want, seq_len, rank, world, tuple(x.shape)))


def _owner_rows(grad: Tensor, seq_len: int, group) -> Tensor:
    """Rows of a whole key-side gradient [B, T, ...] partial on each rank, summed over the ranks
    for the rows this rank owns (its part's layout), in rank order: one all-to-all of padded
    pieces, then a fixed-order sum (deterministic for a fixed P)."""
    world, rank = _world(group)
    send = [_padded(shard(grad, r, world), seq_len, world) for r in range(world)]
    recv = [torch.empty_like(send[0]) for _ in range(world)]
    dist.all_to_all(recv, send, group=group)
    total = recv[0]
    for r in range(1, world):
        total = total + recv[r]
    return total[:, :local_length(seq_len, rank, world)]


class _ContextParallelNSA(torch.autograd.Function):
    """Forward: all-gather K / V, one query-chunk NSA per local chunk (with its own autograd
    graph, kept for the backward). Backward: that graph's gradients, the key side's summed on
    their owners."""

    @staticmethod
    def forward(ctx, config, seq_len, group, q, k, v, g_cmp, g_slc, g_swa):
        world, rank = _world(group)
        b = zigzag_bounds(seq_len, world)
        K = _assemble(_gather_parts(k.detach(), seq_len, group), seq_len)
        V = _assemble(_gather_parts(v.detach(), seq_len, group), seq_len)
        # the chunks' own graph only when a gradient is wanted (an eval forward keeps nothing)
        want = any(ctx.needs_input_grad[3:])
        with torch.set_grad_enabled(want):
            qd = q.detach().requires_grad_(want and q.requires_grad)
            Kd = K.requires_grad_(want and k.requires_grad)
            Vd = V.requires_grad_(want and v.requires_grad)
            gd = [None if g is None else g.detach().requires_grad_(want and g.requires_grad) for g in (g_cmp, g_slc, g_swa)]
            outs, row = [], 0
            for c in _chunks(rank, world):
                n, end = b[c + 1] - b[c], b[c + 1]
                gs = [None if g is None else g[:, row:row + n] for g in gd]
                if n > 0:
                    outs.append(_core_nsa(qd[:, row:row + n], Kd[:, :end], Vd[:, :end], gs, config))
                row += n
            o = torch.cat(outs, dim=1) if outs else q.new_zeros(q.shape[:3] + (v.shape[3],))
        ctx.inner = (o, [qd, Kd, Vd] + gd) if want else None
        ctx.cp = (seq_len, group)
        return o.detach()

    @staticmethod
    def backward(ctx, dout):
        o, inputs = ctx.inner
        seq_len, group = ctx.cp
        del ctx.inner
        want = [x for x in inputs if x is not None and x.requires_grad]
        grads = dict(zip(map(id, want), torch.autograd.grad(o, want, dout, allow_unused=True) if o.requires_grad else
                         [None] * len(want)))
        out = []
        for i, x in enumerate(inputs):
            gx = grads.get(id(x)) if x is not None else None
            if gx is None and x is not None and x.requires_grad:
                # unused here -- a rank without rows (more ranks than chunks of tokens) has no
                # graph: zeros, not None (and K / V's zeros still join every rank's exchange)
                gx = torch.zeros_like(x)
            if gx is not None and i in (1, 2):  # K, V: whole-sequence partials -> this rank's rows
                gx = _owner_rows(gx, seq_len, group)
            out.append(gx)
        return (None, None, None) + tuple(out)


def _core_nsa(q, k, v, gates, config):
    from . import native_sparse_attention as nsa_call
    return nsa_call(q, k, v, gates[0], gates[1], gates[2], config=config)


def native_sparse_attention(q: Tensor, k: Tensor, v: Tensor, g_cmp: Optional[Tensor], g_slc: Optional[Tensor],
                            g_swa: Optional[Tensor], config=None, *, seq_len: int, group=None) -> Tensor:
    """NSA (nsa.native_sparse_attention) of sequences of seq_len positions split over the ranks of
    `group` (default: the world), called on every rank with its part of each tensor:
    q [B, L, HQ, DK], k [B, L, H, DK], v [B, L, H, DV], g_* [B, L, HQ] or None, where L =
    local_length(seq_len, rank, P) and the rows are this rank's two zigzag chunks (`shard`).
    Returns this rank's rows of o [B, L, HQ, DV]; autograd gives this rank's rows of dq, dk, dv
    and the gate gradients. config: nsa.Config (default: the paper's). Mean-pooled compression
    (the default of nsa.native_sparse_attention); every rank must pass the same seq_len,
    config and gate presence."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("nsa.distributed needs an initialised torch.distributed process group")
    for name, x in (("q", q), ("k", k), ("v", v), ("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa)):
        _check_part(x, name, seq_len, group)
    config = _core._as_config(config)
    return _ContextParallelNSA.apply(config, seq_len, group, q, k, v, g_cmp, g_slc, g_swa)
