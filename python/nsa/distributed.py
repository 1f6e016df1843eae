"""nsa.distributed -- context parallelism: NSA over sequences split across the ranks of a
torch.distributed process group (NCCL on GPUs, gloo on the CPU), with autograd.

Layout (zigzag): the T positions of the sequences are cut into 2P chunks for P ranks, chunk c
holding positions [bounds[c], bounds[c + 1]) with bounds[c] = c * T // (2P); rank r holds
chunks r and 2P - 1 - r, in that order, along dim 1 of every per-position tensor (q, k, v, the
gates, the output). Pairing an early chunk with a late one evens out the causal cost, which
grows with the position in the compressed branch. `shard` cuts a whole tensor into a rank's
part, `gather` rebuilds the whole tensor from every rank's part, `positions` gives the
positions of a rank's rows (for rotary embeddings).

One call, on every rank of the group. Each chunk runs the library's query-chunk NSA (queries of
the chunk against keys [0, end of the chunk), nsa.h "Query chunks") -- compression, selection,
the three branches and the gates, exactly the rows of the whole-sequence call -- with its own
autograd graph. Every query reads keys from the start of its sequence, so K and V travel:
  forward: rank r's first chunk reads keys [0, bounds[r + 1]), chunks 0..r, which are the first
    chunks of ranks 0..r. K and V therefore move in two all-gathers (K and V side by side in
    one buffer each): every rank's first chunk, then every rank's second chunk. The rank
    computes its first chunk as soon as the first gather is in, while the second is in flight,
    then its second chunk against keys [0, bounds[2P - r]). For the backward it keeps the first
    half of K and V (the first chunk's keys) and the second chunk's key prefix, up to 1.5 T
    rows of each;
  backward: the query-side gradients (q, gates) stay local. The second chunk's gradients come
    first, and its key-side partial (dk, dv at every position up to the chunk's end) leaves for
    the rows' owners in an all-to-all that runs while the first chunk's gradients are computed.
    That chunk's partial covers only first chunks (rows [0, bounds[r + 1])), so the second
    all-to-all, the one left exposed, carries first-chunk rows alone. Each owner sums the
    pieces of its rows in a fixed order (the second chunks' partials in rank order, then the
    first chunks'), in float32 for 16-bit dtypes rounded once, so the result is deterministic
    for a fixed P.
overlap=False issues the same collectives and sums but waits for each as soon as it is issued,
both backward exchanges after both chunks' gradients (as one exchange would be): the same bits,
with none of the communication hidden (the baseline of bench/cp.py).
Every rank holds B whole batch entries' chunks; varlen packing (cu_seqlens) is not supported
here. Outputs, the selection and every gradient equal the single-process call's up to the
order of floating-point sums in dk / dv.
"""
import math
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


def _chunk_len(b: Sequence[int], c: int) -> int:
    return b[c + 1] - b[c]


class _Slots:
    """Tensors of the given (dtype, shape)s side by side in one flat byte buffer, each slot
    16-byte aligned, so one collective moves K and V (or dK and dV) together whatever their
    dtypes."""

    def __init__(self, specs):
        self.specs, self.offsets, n = list(specs), [], 0
        for dtype, shape in self.specs:
            self.offsets.append(n)
            n += -(-math.prod(shape) * dtype.itemsize // 16) * 16
        self.nbytes = n

    def views(self, buf: Tensor, base: int = 0) -> List[Tensor]:
        """The slots in the uint8 buffer `buf`, starting at byte `base`, as typed tensors."""
        return [buf[base + o:base + o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for o, (dtype, shape) in zip(self.offsets, self.specs)]


def _rows_spec(xs: Sequence[Tensor], rows: int):
    """(dtype, shape) of each x [B, n, ...] with `rows` positions."""
    return [(x.dtype, (x.shape[0], rows) + tuple(x.shape[2:])) for x in xs]


class _Pending:
    """A collective in flight (or done, when issued without async_op) and the buffers it reads
    and writes, kept alive until it is waited for."""

    def __init__(self, work, *buffers):
        self.work, self.buffers = work, buffers

    def wait(self):
        if self.work is not None:
            self.work.wait()
        self.work = self.buffers = None


def _all_gather_bytes(buf: Tensor, group, async_op: bool) -> Tuple[_Pending, Tensor]:
    """Every rank's uint8 buffer (all the same size), concatenated in rank order."""
    world, _ = _world(group)
    out = buf.new_empty(world * buf.numel())
    if buf.is_cpu or dist.get_backend(group) == dist.Backend.GLOO:  # gloo: a list of outputs
        work = dist.all_gather(list(out.view(world, buf.numel()).unbind(0)), buf, group=group, async_op=async_op)
    else:  # one output, no copy out of a staging buffer
        work = dist.all_gather_into_tensor(out, buf, group=group, async_op=async_op)
    return _Pending(work, buf, out), out


def _start_gather(xs: Sequence[Tensor], rows: int, group, async_op: bool) -> Tuple[_Pending, List[List[Tensor]]]:
    """All-gather of this rank's xs [B, n, ...] (n <= rows; k's and v's rows of one chunk),
    each padded to `rows` positions: returns the collective and, per rank, its xs' slots."""
    world, _ = _world(group)
    slots = _Slots(_rows_spec(xs, rows))
    buf = torch.empty(slots.nbytes, dtype=torch.uint8, device=xs[0].device)
    for x, slot in zip(xs, slots.views(buf)):
        slot[:, :x.shape[1]].copy_(x)
        slot[:, x.shape[1]:].zero_()
    pending, out = _all_gather_bytes(buf, group, async_op)
    return pending, [slots.views(out, s * slots.nbytes) for s in range(world)]


def _gather_rows(b: Sequence[int], world: int) -> Tuple[int, int]:
    """Rows each rank sends in the two all-gathers: the longest first chunk (chunks 0..P-1) and
    the longest second chunk (chunks P..2P-1); shorter ones are padded."""
    return max(_chunk_len(b, c) for c in range(world)), max(_chunk_len(b, c) for c in range(world, 2 * world))


def _exchange_chunks(src: int, dst: int, world: int, late: bool) -> List[int]:
    """The chunks of owner `dst`'s part covered by rank `src`'s key-side partial, in the part's
    order. The second chunk 2P-1-src reads keys [0, b[2P - src]): every first chunk, and the
    second chunk of every rank dst >= src. The first chunk src reads keys [0, b[src + 1]): the
    first chunk of every rank dst <= src."""
    c0, c1 = _chunks(dst, world)
    if late:
        return [c0, c1] if dst >= src else [c0]
    return [c0] if dst <= src else []


def _exchange_layout(like: Sequence[Tensor], b: Sequence[int], world: int, rank: int, late: bool):
    """Slots of the all-to-all that moves one chunk's key-side partials (tensors shaped like
    `like`, [B, n, H, D]) to their owners: what this rank sends to each rank, and receives from
    each (a piece per partial, the owner's rows in the part's order)."""
    def slots(src, dst):
        rows = sum(_chunk_len(b, c) for c in _exchange_chunks(src, dst, world, late))
        return _Slots(_rows_spec(like, rows))
    return [slots(rank, d) for d in range(world)], [slots(s, rank) for s in range(world)]


def _start_exchange(grads: Sequence[Tensor], b: Sequence[int], group, late: bool,
                    async_op: bool) -> Tuple[_Pending, List[List[Tensor]]]:
    """Sends each owner the rows of its part that this rank's partials `grads` (one chunk's dk
    and / or dv, rows [0, end of the chunk)) cover: returns the collective and, per source rank,
    its pieces (views into the receive buffer, valid once the collective is waited for)."""
    world, rank = _world(group)
    send, recv = _exchange_layout(grads, b, world, rank, late)
    sbuf = torch.empty(sum(x.nbytes for x in send), dtype=torch.uint8, device=grads[0].device)
    base = 0
    for d, slots in enumerate(send):
        for g, piece in zip(grads, slots.views(sbuf, base)):
            row = 0
            for c in _exchange_chunks(rank, d, world, late):
                piece[:, row:row + _chunk_len(b, c)].copy_(g[:, b[c]:b[c + 1]])
                row += _chunk_len(b, c)
        base += slots.nbytes
    rbuf = sbuf.new_empty(sum(x.nbytes for x in recv))
    work = dist.all_to_all_single(rbuf, sbuf, [x.nbytes for x in recv], [x.nbytes for x in send], group=group,
                                  async_op=async_op)
    pieces, base = [], 0
    for slots in recv:
        pieces.append(slots.views(rbuf, base))
        base += slots.nbytes
    return _Pending(work, sbuf, rbuf), pieces


def _add_pieces(pieces: Sequence[Tensor], acc: Optional[Tensor] = None) -> Tensor:
    """acc plus each piece on its leading rows, in order; without acc, the first piece (a copy,
    float32 for 16-bit dtypes, rounded once by the caller) plus the others. The owner's pieces
    from the second chunks (rank 0's covers the whole part) come in rank order, then those from
    the first chunks (first-chunk rows; empty from the ranks that hold none)."""
    if acc is None:
        acc = pieces[0].to(torch.float32 if pieces[0].dtype.itemsize < 4 else pieces[0].dtype, copy=True)
        pieces = pieces[1:]
    for piece in pieces:
        acc[:, :piece.shape[1]] += piece
    return acc


def _chunk_graph(want: bool, needs: Sequence[bool], q, k, v, gates, config) -> Tuple[Optional[Tensor], List, Tensor]:
    """One query chunk's NSA (q [B, n, HQ, DK] against keys k, v [B, end of the chunk, H, D])
    with its own graph when a gradient is wanted: (its output with the graph, or None for an
    empty chunk or no gradient; its leaves; the output, detached)."""
    leaves = [None if x is None else x.detach().requires_grad_(want and need)
              for x, need in zip([q, k, v] + list(gates), needs)]
    if q.shape[1] == 0:
        return None, leaves, q.new_zeros(q.shape[:3] + (v.shape[3],))
    with torch.set_grad_enabled(want):
        o = _core_nsa(leaves[0], leaves[1], leaves[2], leaves[3:], config)
    return (o if want else None), leaves, o.detach()


def _chunk_grads(o: Optional[Tensor], leaves, dout: Tensor) -> List[Optional[Tensor]]:
    """The gradients of one chunk's leaves that require one (zeros where the graph does not reach
    them, e.g. an empty chunk: every rank's partials join the exchange), None for the others."""
    want = [x for x in leaves if x is not None and x.requires_grad]
    got = torch.autograd.grad(o, want, dout, allow_unused=True) if o is not None and want else [None] * len(want)
    grads = dict(zip(map(id, want), got))
    out = []
    for x in leaves:
        g = grads.get(id(x)) if x is not None else None
        out.append(torch.zeros_like(x) if g is None and x is not None and x.requires_grad else g)
    return out


class _ContextParallelNSA(torch.autograd.Function):
    """Forward: K / V gathered in two halves, one query-chunk NSA per local chunk (each with its
    own autograd graph, kept for the backward), the first chunk computed while the second half
    is in flight. Backward: the second chunk's gradients, its key-side partial sent to the
    owners while the first chunk's are computed, then the first chunk's partial; the owners
    sum the pieces in a fixed order."""

    @staticmethod
    def forward(ctx, config, seq_len, group, overlap, grad_mode, q, k, v, g_cmp, g_slc, g_swa):
        world, rank = _world(group)
        b = zigzag_bounds(seq_len, world)
        c0, c1 = _chunks(rank, world)
        n0 = _chunk_len(b, c0)
        needs = ctx.needs_input_grad[5:]
        want = grad_mode and any(needs)
        kd, vd = k.detach(), v.detach()
        # every rank's first chunk (keys [0, b[P])), then every rank's second chunk, issued once
        # the first is in: one collective in flight at a time (gloo runs concurrent ones on
        # worker threads of its own), the second one during chunk r's computation
        rows0, rows1 = _gather_rows(b, world)
        first, first_parts = _start_gather([kd[:, :n0], vd[:, :n0]], rows0, group, overlap)
        first.wait()
        second, second_parts = _start_gather([kd[:, n0:], vd[:, n0:]], rows1, group, overlap)
        if not overlap:
            second.wait()
        # keys [0, b[P]) in order: chunk s is rank s's first
        K1, V1 = (torch.cat([first_parts[s][i][:, :_chunk_len(b, s)] for s in range(world)], dim=1) for i in (0, 1))
        del first, first_parts
        gates = [g_cmp, g_slc, g_swa]
        qd, gd = q.detach(), [None if g is None else g.detach() for g in gates]
        # chunk r reads keys [0, b[r + 1]): all in the first half, computed while the second is in flight
        end0 = b[c0 + 1]
        early = _chunk_graph(want, needs, qd[:, :n0], K1[:, :end0], V1[:, :end0],
                             [None if g is None else g[:, :n0] for g in gd], config)
        second.wait()
        # keys [0, b[2P - r]): the first half, then chunks P..2P-1-r, the second chunks of ranks P-1 down to r
        K, V = (torch.cat([X] + [second_parts[s][i][:, :_chunk_len(b, 2 * world - 1 - s)]
                                 for s in range(world - 1, rank - 1, -1)], dim=1) for i, X in ((0, K1), (1, V1)))
        del second, second_parts
        late = _chunk_graph(want, needs, qd[:, n0:], K, V, [None if g is None else g[:, n0:] for g in gd], config)
        ctx.inner = (early[:2], late[:2]) if want else None
        ctx.cp = (seq_len, group, overlap)
        return torch.cat([early[2], late[2]], dim=1)

    @staticmethod
    def backward(ctx, dout):
        (o0, leaves0), (o1, leaves1) = ctx.inner
        seq_len, group, overlap = ctx.cp
        del ctx.inner
        world, rank = _world(group)
        b = zigzag_bounds(seq_len, world)
        n0 = _chunk_len(b, rank)
        kv = [i for i in (1, 2) if leaves1[i].requires_grad]  # the key-side partials that travel
        dtypes = [leaves1[i].dtype for i in kv]

        def send(grads, late):
            """Starts the exchange of one chunk's key-side partials (waited for at once without overlap)."""
            sent = _start_exchange([grads[i] for i in kv], b, group, late, overlap) if kv else (_Pending(None), [])
            for i in kv:
                grads[i] = None  # copied into the send buffer
            if not overlap:
                sent[0].wait()
            return sent

        # the second chunk first: its partial, the bigger one, travels while the first chunk's
        # gradients are computed. Without overlap both exchanges follow both chunks: a wait
        # between the chunks would be a second point where the ranks meet, adding the chunks'
        # imbalance (rank r's second chunk costs more than rank r + 1's) to a comparison that
        # should differ only by the communication.
        g1 = _chunk_grads(o1, leaves1, dout[:, n0:])
        del o1, leaves1
        if overlap:
            late = send(g1, True)
        g0 = _chunk_grads(o0, leaves0, dout[:, :n0])
        del o0, leaves0
        if not overlap:
            late = send(g1, True)
        late[0].wait()  # one collective in flight at a time, as in the forward
        early = send(g0, False)
        # q and the gates: this rank's rows, chunk r then chunk 2P-1-r
        out = [None if a is None else torch.cat([a, c], dim=1) for a, c in zip(g0, g1)]
        # the second chunks' pieces are added while the first chunks' are in flight
        acc = [_add_pieces([p[j] for p in late[1]]) for j in range(len(kv))]
        early[0].wait()
        for j, i in enumerate(kv):
            out[i] = _add_pieces([p[j] for p in early[1]], acc[j]).to(dtypes[j])
        return (None,) * 5 + tuple(out)


def _collectives_alone(k: Tensor, v: Tensor, seq_len: int, group=None, backward: bool = False):
    """The communication of one call on this rank's k [B, L, H, DK], v [B, L, H, DV] without the
    NSA: buffers of the sizes the call moves (the backward's exchanges with both k and v
    requiring a gradient), allocated once, and a function that issues the call's collectives on
    them in its order, each waited for. Returns (that function, the bytes this rank sends to the
    other ranks). bench/cp.py times it against the calls with and without overlap."""
    world, rank = _world(group)
    b = zigzag_bounds(seq_len, world)
    gathers, exchanges, sent = [], [], 0
    for rows in _gather_rows(b, world):
        slots = _Slots(_rows_spec([k, v], rows))
        gathers.append(torch.zeros(slots.nbytes, dtype=torch.uint8, device=k.device))
        sent += (world - 1) * slots.nbytes
    for late in ((True, False) if backward else ()):
        send, recv = _exchange_layout([k, v], b, world, rank, late)
        out_sizes, in_sizes = [x.nbytes for x in recv], [x.nbytes for x in send]
        exchanges.append((torch.empty(sum(out_sizes), dtype=torch.uint8, device=k.device),
                          torch.zeros(sum(in_sizes), dtype=torch.uint8, device=k.device), out_sizes, in_sizes))
        sent += sum(n for d, n in enumerate(in_sizes) if d != rank)

    def run():
        for buf in gathers:
            _all_gather_bytes(buf, group, False)
        for rbuf, sbuf, out_sizes, in_sizes in exchanges:
            dist.all_to_all_single(rbuf, sbuf, out_sizes, in_sizes, group=group)
    return run, sent


def _core_nsa(q, k, v, gates, config):
    from . import native_sparse_attention as nsa_call
    return nsa_call(q, k, v, gates[0], gates[1], gates[2], config=config)


def native_sparse_attention(q: Tensor, k: Tensor, v: Tensor, g_cmp: Optional[Tensor], g_slc: Optional[Tensor],
                            g_swa: Optional[Tensor], config=None, *, seq_len: int, group=None,
                            overlap: bool = True) -> Tensor:
    """NSA (nsa.native_sparse_attention) of sequences of seq_len positions split over the ranks of
    `group` (default: the world), called on every rank with its part of each tensor:
    q [B, L, HQ, DK], k [B, L, H, DK], v [B, L, H, DV], g_* [B, L, HQ] or None, where L =
    local_length(seq_len, rank, P) and the rows are this rank's two zigzag chunks (`shard`).
    Returns this rank's rows of o [B, L, HQ, DV]; autograd gives this rank's rows of dq, dk, dv
    and the gate gradients. config: nsa.Config (default: the paper's). Mean-pooled compression
    (the default of nsa.native_sparse_attention); every rank must pass the same seq_len,
    config and gate presence. overlap=False waits for every collective as soon as it is
    issued (the backward's exchanges after both chunks' gradients) instead of computing while
    it runs: the same result bit for bit, for measuring what the overlap hides."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("nsa.distributed needs an initialised torch.distributed process group")
    for name, x in (("q", q), ("k", k), ("v", v), ("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa)):
        _check_part(x, name, seq_len, group)
    config = _core._as_config(config)
    return _ContextParallelNSA.apply(config, seq_len, group, bool(overlap), torch.is_grad_enabled(), q, k, v,
                                     g_cmp, g_slc, g_swa)
