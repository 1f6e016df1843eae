"""The torch custom ops of nsa.flex_attention: nsa::flex_fwd and nsa::flex_bwd (torch.compile
traces them; autograd reaches q, k, v and the float tensors a score_mod reads). Apart from
nsa/flex.py because torch.library reads the ops' annotations, which must be real types here
(flex.py postpones its annotations)."""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .flex import BlockMask, _backward, _forward, _mod_of
from ._torch import plain_eager

_OPS = None


def _block_mask_of(lists, mask_handle, q_block, kv_block):
    if lists[0] is None and not mask_handle:
        return None
    return BlockMask(lists[0], lists[1], lists[2], lists[3], (q_block, kv_block), _mod_of(mask_handle))


def _fwd_impl(q, k, v, lists, mask_handle, score_handle, q_block, kv_block, scale):
    o, lse = _forward(q, k, v, _block_mask_of(lists, mask_handle, q_block, kv_block), _mod_of(score_handle), scale)
    return o.contiguous(), lse.contiguous()


def _bwd_impl(dout, q, k, v, o, lse, lists, floats, mask_handle, score_handle, q_block, kv_block, scale, want):
    """dq, dk, dv and the gradients of the floats whose bit is set in `want` (in their order: a
    tensor that needs none costs no scatter)."""
    bm = _block_mask_of(lists, mask_handle, q_block, kv_block)
    score = _mod_of(score_handle)
    wanted = [(i, t) for n, (i, t) in enumerate(zip(score.float_idx, floats)) if want >> n & 1] if score else []
    (dq, dk, dv), tens = _backward(q, k, v, o, lse, dout, bm, score, scale, [i for i, _ in wanted])
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), [tens[i].to(t.dtype) for i, t in wanted]


def _save(ctx, q, k, v, o, lse, lists, floats, scalars):
    """What both backwards read: q, k, v, o, lse, the present lists and the floats saved (a write
    into one before the backward is an error), which floats want a gradient, the scalars, and the
    mods kept alive until the backward has run."""
    ctx.save_for_backward(q, k, v, o, lse, *[x for x in lists if x is not None], *floats)
    ctx.present = tuple(x is not None for x in lists)
    ctx.nfloats = len(floats)
    ctx.want = sum(1 << n for n, t in enumerate(floats) if t.requires_grad)
    ctx.scalars = tuple(scalars)
    ctx.mods = (_mod_of(scalars[0]), _mod_of(scalars[1]))
    ctx.mark_non_differentiable(lse)


def _saved(ctx):
    """(q, k, v, o, lse, the four lists, the floats) as _save left them."""
    saved = list(ctx.saved_tensors)
    rest = saved[5:]
    lists = tuple(rest.pop(0) if p else None for p in ctx.present)
    return tuple(saved[:5]) + (lists, rest[:ctx.nfloats])


def _float_grads(ctx, dts):
    """The floats' gradients in their order: dts for those that want one, None for the others."""
    it = iter(dts)
    return [next(it) if ctx.want >> n & 1 else None for n in range(ctx.nfloats)]


class _FlexFunction(torch.autograd.Function):
    """The eager path: what nsa::flex_fwd / nsa::flex_bwd compute, without the custom ops'
    dispatch (a few hundred microseconds a forward and backward, a small call's whole budget).
    Inputs: q, k, v, the four lists, the mod handles, the block sizes, the scale, then the
    score_mod's float tensors (their gradients where they require one)."""

    @staticmethod
    def forward(ctx, q, k, v, n, i, fn, fi, mask_handle, score_handle, q_block, kv_block, scale, *floats):
        lists, scalars = (n, i, fn, fi), (mask_handle, score_handle, q_block, kv_block, scale)
        o, lse = _fwd_impl(q, k, v, lists, *scalars)
        _save(ctx, q, k, v, o, lse, lists, floats, scalars)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, lists, floats = _saved(ctx)
        dq, dk, dv, dts = _bwd_impl(do.contiguous(), q, k, v, o, lse, lists, floats, *ctx.scalars, ctx.want)
        return (dq, dk, dv) + (None,) * 9 + tuple(_float_grads(ctx, dts))


def flex_eager(q, k, v, lists, floats, mask_handle, score_handle, q_block, kv_block, scale):
    """(o, lse) through _FlexFunction when the call is plain eager (nsa._torch.plain_eager; the
    score_mod's tensors may also be parameters, as learnable biases are), else None."""
    if not plain_eager(q, k, v, *lists) or any(type(t) not in (Tensor, torch.nn.Parameter) for t in floats):
        return None
    return _FlexFunction.apply(q, k, v, *lists, mask_handle, score_handle, q_block, kv_block, scale, *floats)


def flex_op():
    """nsa::flex_fwd / nsa::flex_bwd custom ops (torch.compile traces them; autograd through
    q, k, v and the score_mod's float tensors). Mods travel as their handles."""
    global _OPS
    if _OPS is not None:
        return _OPS

    @torch.library.custom_op("nsa::flex_fwd", mutates_args=())
    def flex_fwd(q: Tensor, k: Tensor, v: Tensor, kv_num_blocks: Optional[Tensor], kv_indices: Optional[Tensor],
                 full_kv_num_blocks: Optional[Tensor], full_kv_indices: Optional[Tensor], floats: List[Tensor],
                 mask_handle: int, score_handle: int, q_block: int, kv_block: int, scale: float) -> Tuple[Tensor, Tensor]:
        return _fwd_impl(q, k, v, (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), mask_handle,
                         score_handle, q_block, kv_block, scale)

    @flex_fwd.register_fake
    def _(q, k, v, *rest):
        return (q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3])),
                q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32))

    @torch.library.custom_op("nsa::flex_bwd", mutates_args=())
    def flex_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, kv_num_blocks: Optional[Tensor],
                 kv_indices: Optional[Tensor], full_kv_num_blocks: Optional[Tensor], full_kv_indices: Optional[Tensor],
                 floats: List[Tensor], mask_handle: int, score_handle: int, q_block: int, kv_block: int,
                 scale: float, want: int) -> Tuple[Tensor, Tensor, Tensor, List[Tensor]]:
        """The gradients of q, k, v and of the floats whose bit is set in `want` (_bwd_impl)."""
        return _bwd_impl(dout, q, k, v, o, lse, (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), floats,
                         mask_handle, score_handle, q_block, kv_block, scale, want)

    @flex_bwd.register_fake
    def _(dout, q, k, v, o, lse, a, b, c, d, floats, mask_handle, score_handle, q_block, kv_block, scale, want):
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                [torch.empty_like(t) for n, t in enumerate(floats) if want >> n & 1])

    def setup_context(ctx, inputs, output):
        _save(ctx, *inputs[:3], output[0], output[1], inputs[3:7], inputs[7], inputs[8:])

    def backward(ctx, do, dlse):
        q, k, v, o, lse, lists, floats = _saved(ctx)
        dq, dk, dv, dts = flex_bwd(do.contiguous(), q, k, v, o, lse, *lists, floats, *ctx.scalars, ctx.want)
        return (dq, dk, dv, None, None, None, None, _float_grads(ctx, dts)) + (None,) * len(ctx.scalars)

    flex_fwd.register_autograd(backward, setup_context=setup_context)
    _OPS = flex_fwd
    return _OPS


