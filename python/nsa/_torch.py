"""PyTorch integration: the C calls on torch tensors (CPU, or CUDA on the tensor's device and
the current stream), as custom ops with autograd and fake (meta) implementations, so that
torch.compile(fullgraph=True) traces through them. Imported by nsa when torch is installed.

Ops (torch.ops.nsa.*):
  forward(q, k, v, k_cmp?, v_cmp?, k_slc?, v_slc?, k_swa?, v_swa?, g_cmp?, g_slc?, g_swa?,
          block_indices?, block_counts?, cu_seqlens?, <config ints>, scale, swa_scale)
      -> (o, block_indices_saved, o_cmp, o_slc, o_swa, lse_cmp, lse_slc, lse_swa)
  backward(dout, <forward's tensors>, <forward's saved outputs>, <config>)
      -> (dq, dk, dv, dk_cmp, dv_cmp, dk_slc, dv_slc, dk_swa, dv_swa, dg_cmp, dg_slc, dg_swa)
Outputs of absent branches / inputs are empty tensors (shape [0]); the wrappers map them to None.
"""
import ctypes
import dataclasses
import weakref
from struct import pack_into as _pack_into
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _core, _lib
from ._core import NsaError

_TORCH_DTYPES = {
    torch.float32: _lib.DTYPE_F32,
    torch.float16: _lib.DTYPE_F16,
    torch.bfloat16: _lib.DTYPE_BF16,
    torch.int32: _lib.DTYPE_I32,
    torch.uint8: _lib.DTYPE_U8,
}


_VIEWS = {}  # (data_ptr, dtype code, shape, strides) -> nsa_tensor
# id(tensor) -> (weak reference to it, device index, data_ptr, shape, strides, dtype, nsa_tensor):
# the view an input tensor had at its last call, found without the checks and the key above.
# Kept beside the tensor, not on it (an attribute would travel into torch.save, copy.deepcopy
# and pickle, which cannot take the C struct), and dropped when the tensor dies.
_SEEN = {}


def _remember(t, entry):
    k = id(t)

    def forget(ref, k=k):
        if _SEEN.get(k, (None,))[0] is ref:  # (not a later tensor that reuses the id)
            _SEEN.pop(k, None)
    try:
        ref = weakref.ref(t, forget)
    except TypeError:  # a tensor type without weak references: no shortcut
        return
    if len(_SEEN) >= 4096:
        _SEEN.clear()
    _SEEN[k] = (ref,) + entry


class TorchCall(_core.Call):
    """torch tensors: CPU tensors on the CPU backend; CUDA tensors on the CUDA backend with
    the tensor's device and torch's current stream (a context is cached per device/stream).
    Outputs and the workspace are allocated by torch on the same device."""

    def __init__(self, device):
        super().__init__()
        if device.type == "cuda":
            self.backend = _lib.BACKEND_CUDA
            self.index = device.index if device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", self.index)
        elif device.type == "cpu":
            self.backend = _lib.BACKEND_CPU
            self.device = torch.device("cpu")
            self.index = -1  # Tensor.get_device() of a CPU tensor
        else:
            raise NsaError(_lib.STATUS_BACKEND_UNAVAILABLE, "tensors on %s (nsa runs on cpu and cuda)" % device)

    def view(self, t, name, output=False):
        # a tensor seen before with the same memory and layout (a decode loop's caches, tables and
        # buffers every step): its struct, kept beside the tensor in _SEEN, after a few reads
        # instead of the checks and the key lookup below
        seen = _SEEN.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == self.index and seen[2] == t.data_ptr() \
                and seen[3] == t.shape and seen[4] == t.stride() and seen[5] is t.dtype:
            self.keep.append(t)
            return seen[6]
        given = t
        if not isinstance(t, Tensor):
            raise TypeError("%s must be a torch.Tensor, not %s" % (name, type(t).__name__))
        if t.get_device() != self.index or (self.index < 0 and not t.is_cpu):  # t.device builds an object
            raise NsaError(_lib.STATUS_BAD_ARGUMENT, "%s is on %s but q is on %s" % (name, t.device, self.device))
        if t.dtype == torch.bool and not output:  # masks: one byte per element, nonzero = keep
            t = t.view(torch.uint8)
        code = _TORCH_DTYPES.get(t.dtype)
        if code is None:
            raise NsaError(_lib.STATUS_BAD_DTYPE, "%s has dtype %s (float32, float16, bfloat16 or int32 only)"
                           % (name, t.dtype))
        shape, strides = t.shape, t.stride()
        if shape and shape[-1] > 1 and strides[-1] != 1:
            if output:
                raise NsaError(_lib.STATUS_BAD_STRIDE, "%s: an output needs a unit last-dim stride" % name)
            t = t.contiguous()
            strides = t.stride()
        self.keep.append(t)
        # the view of the same memory, dtype and layout is the same struct: a decode loop hands
        # the same caches, tables and buffers every step (the struct is copied where it is used)
        key = (t.data_ptr(), code, shape, strides)
        v = _VIEWS.get(key)
        if v is None:
            v = _core._make_view(key[0], code, shape, strides, name)
            if len(_VIEWS) >= 512:
                _VIEWS.clear()
            _VIEWS[key] = v
        if not output and t is given:  # (not a copy or a bool mask's uint8 view: new tensors each call)
            _remember(t, (self.index, key[0], shape, strides, t.dtype, v))
        return v

    def empty(self, shape, dtype):
        if dtype == "f32":
            dtype = torch.float32
        elif dtype == "i32":
            dtype = torch.int32
        return torch.empty(tuple(int(s) for s in shape), dtype=dtype, device=self.device)

    @staticmethod
    def dtype(a):
        return a.dtype

    def workspace(self, nbytes):
        if nbytes == 0:
            return None
        ws = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.keep.append(ws)
        return ws.data_ptr()

    def context(self):
        if self.backend == _lib.BACKEND_CPU:
            return _core.context(_lib.BACKEND_CPU)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        return _core.context(_lib.BACKEND_CUDA, self.index, stream)

    def run(self, op, args):
        if self.backend == _lib.BACKEND_CUDA and torch.cuda.current_device() != self.index:
            with torch.cuda.device(self.index):
                return super().run(op, args)
        return super().run(op, args)


# ---- the custom ops -----------------------------------------------------------------------------

_OPT_NAMES = ("k_cmp", "v_cmp", "k_slc", "v_slc", "k_swa", "v_swa", "g_cmp", "g_slc", "g_swa",
              "block_indices", "block_counts", "cu_seqlens")
_CFG_NAMES = ("cmp_len", "cmp_stride", "slc_block", "slc_topk", "n_init", "n_local", "window", "scale")
# The gradient outputs of the backward op, in order, and the forward input each belongs to.
_GRAD_NAMES = ("q", "k", "v", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_swa", "v_swa", "g_cmp", "g_slc", "g_swa")


def _empty(like, dtype):
    return torch.empty((0,), dtype=dtype, device=like.device)


def _unpack(q, k, v, opt, cfg):
    tensors = dict(q=q, k=k, v=v)
    tensors.update(zip(_OPT_NAMES, opt))
    cu = tensors.pop("cu_seqlens")
    return tensors, cu, _core.Config(*cfg)


def _saved_present(tensors):
    """Which of _core.SAVED the forward writes, from the inputs alone (also for fake tensors)."""
    slc_sel = tensors.get("g_slc") is not None and tensors.get("block_indices") is None
    present = {"block_indices": slc_sel}
    for br in _core.BRANCHES:
        on = tensors.get("g_" + br) is not None
        present["o_" + br] = on
        present["lse_" + br] = on
    return present


def _forward_impl(q, k, v, *rest):
    opt, cfg = rest[:len(_OPT_NAMES)], rest[len(_OPT_NAMES):]
    tensors, cu, config = _unpack(q, k, v, opt, cfg)
    o, saved = _core.forward(TorchCall(q.device), tensors, config, cu)
    out = [o]
    for name in _core.SAVED:
        if name in saved:
            out.append(saved[name])
        else:
            out.append(_empty(q, torch.int32 if name == "block_indices" else torch.float32))
    return tuple(out)


def _forward_fake(q, k, v, *rest):
    opt, cfg = rest[:len(_OPT_NAMES)], rest[len(_OPT_NAMES):]
    tensors, _, config = _unpack(q, k, v, opt, cfg)
    B, T, HQ = q.shape[0], q.shape[1], q.shape[2]
    H, DV = k.shape[2], v.shape[3]
    present = _saved_present(tensors)
    out = [q.new_empty((B, T, HQ, v.shape[3]))]
    out.append(q.new_empty((B, T, H, config.slc_topk), dtype=torch.int32) if present["block_indices"]
               else _empty(q, torch.int32))
    o_dt = q.dtype if q.device.type == "cuda" else torch.float32  # as _core.forward saves them
    for name in _core.SAVED[1:]:
        is_o = name.startswith("o_")
        shape = (B, T, HQ, DV) if is_o else (B, T, HQ)
        out.append(q.new_empty(shape, dtype=o_dt if is_o else torch.float32) if present[name] else _empty(q, torch.float32))
    return tuple(out)


def _backward_impl(dout, q, k, v, *rest):
    n = len(_OPT_NAMES)
    opt, saved_t, cfg = rest[:n], rest[n:n + len(_core.SAVED)], rest[n + len(_core.SAVED):]
    tensors, cu, config = _unpack(q, k, v, opt, cfg)
    present = _saved_present(tensors)
    saved = {name: t for name, t in zip(_core.SAVED, saved_t) if present[name]}
    grads = _core.backward(TorchCall(q.device), tensors, saved, config, cu, dout)
    return tuple(grads[name] if name in grads else _empty(q, q.dtype) for name in _GRAD_NAMES)


def _backward_fake(dout, q, k, v, *rest):
    opt = rest[:len(_OPT_NAMES)]
    tensors = dict(q=q, k=k, v=v)
    tensors.update(zip(_OPT_NAMES, opt))
    return tuple(tensors[name].new_empty(tensors[name].shape) if tensors.get(name) is not None else _empty(q, q.dtype)
                 for name in _GRAD_NAMES)


HAS_CUSTOM_OP = hasattr(torch.library, "custom_op")


def _save_forward(ctx, inputs, output):
    """What the backward of nsa::forward needs (both the custom op and the autograd.Function
    path): the tensor inputs, the config scalars, which inputs were given, the saved outputs."""
    n = 3 + len(_OPT_NAMES)
    ctx.n_tensors = n
    ctx.cfg = tuple(inputs[n:])
    ctx.present = tuple([x is not None for x in inputs[:n]])
    ctx.save_for_backward(*inputs[:n], *output[1:])


def _grads_to_inputs(ctx, grads):
    """The backward's gradients (in _GRAD_NAMES order) placed at their inputs' positions; None
    for inputs not given and for the config scalars."""
    out = [None] * (ctx.n_tensors + len(ctx.cfg))
    order = ("q", "k", "v") + _OPT_NAMES
    for name, g in zip(_GRAD_NAMES, grads):
        i = order.index(name)
        if ctx.present[i]:
            out[i] = g
    return tuple(out)

if HAS_CUSTOM_OP:
    # The signatures are spelled out: torch.library infers the op schema from the annotations.
    @torch.library.custom_op("nsa::forward", mutates_args=())
    def forward_op(q: Tensor, k: Tensor, v: Tensor,
                   k_cmp: Optional[Tensor], v_cmp: Optional[Tensor],
                   k_slc: Optional[Tensor], v_slc: Optional[Tensor],
                   k_swa: Optional[Tensor], v_swa: Optional[Tensor],
                   g_cmp: Optional[Tensor], g_slc: Optional[Tensor], g_swa: Optional[Tensor],
                   block_indices: Optional[Tensor], block_counts: Optional[Tensor], cu_seqlens: Optional[Tensor],
                   cmp_len: int, cmp_stride: int, slc_block: int, slc_topk: int, n_init: int, n_local: int,
                   window: int, scale: float, swa_scale: float
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        return _forward_impl(q, k, v, k_cmp, v_cmp, k_slc, v_slc, k_swa, v_swa, g_cmp, g_slc, g_swa,
                             block_indices, block_counts, cu_seqlens,
                             cmp_len, cmp_stride, slc_block, slc_topk, n_init, n_local, window, scale, swa_scale)

    @forward_op.register_fake
    def _(q, k, v, *rest):
        return _forward_fake(q, k, v, *rest)

    @torch.library.custom_op("nsa::backward", mutates_args=())
    def backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                    k_cmp: Optional[Tensor], v_cmp: Optional[Tensor],
                    k_slc: Optional[Tensor], v_slc: Optional[Tensor],
                    k_swa: Optional[Tensor], v_swa: Optional[Tensor],
                    g_cmp: Optional[Tensor], g_slc: Optional[Tensor], g_swa: Optional[Tensor],
                    block_indices: Optional[Tensor], block_counts: Optional[Tensor], cu_seqlens: Optional[Tensor],
                    saved_block_indices: Tensor, o_cmp: Tensor, o_slc: Tensor, o_swa: Tensor,
                    lse_cmp: Tensor, lse_slc: Tensor, lse_swa: Tensor,
                    cmp_len: int, cmp_stride: int, slc_block: int, slc_topk: int, n_init: int, n_local: int,
                    window: int, scale: float, swa_scale: float
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                               Tensor, Tensor]:
        return _backward_impl(dout, q, k, v, k_cmp, v_cmp, k_slc, v_slc, k_swa, v_swa, g_cmp, g_slc, g_swa,
                              block_indices, block_counts, cu_seqlens,
                              saved_block_indices, o_cmp, o_slc, o_swa, lse_cmp, lse_slc, lse_swa,
                              cmp_len, cmp_stride, slc_block, slc_topk, n_init, n_local, window, scale, swa_scale)

    @backward_op.register_fake
    def _(dout, q, k, v, *rest):
        return _backward_fake(dout, q, k, v, *rest)

    def _setup_context(ctx, inputs, output):
        _save_forward(ctx, inputs, output)
        # the saved branch outputs, indices and lse are results, not differentiable outputs:
        # no zero gradients materialised for them (64k paper config: ~2 ms of fills per step)
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)

    def _backward(ctx, grad_o, *unused):
        if grad_o is None:
            return tuple([None] * (ctx.n_tensors + len(ctx.cfg)))
        saved, n = ctx.saved_tensors, ctx.n_tensors
        return _grads_to_inputs(ctx, backward_op(grad_o, *saved[:n], *saved[n:], *ctx.cfg))

    forward_op.register_autograd(_backward, setup_context=_setup_context)

    def _register_autocast():
        """Autocast kernels for nsa::forward: every floating input is cast to the autocast
        dtype read when the op runs (also inside a compiled region that enters autocast), then
        the op runs with autocast excluded. Like torch.library.register_autocast, whose cast
        dtype is fixed at registration."""
        lib = torch.library.Library("nsa", "FRAGMENT")
        for device_type, key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
            keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

            def kernel(*args, _device_type=device_type, _keyset=keyset):
                dtype = torch.get_autocast_dtype(_device_type) if hasattr(torch, "get_autocast_dtype") else (
                    torch.get_autocast_gpu_dtype() if _device_type == "cuda" else torch.get_autocast_cpu_dtype())
                args = tuple(a.to(dtype) if isinstance(a, Tensor) and a.is_floating_point() and a.dtype != dtype
                             else a for a in args)
                with torch._C._ExcludeDispatchKeyGuard(_keyset):
                    return forward_op(*args)

            lib.impl("forward", kernel, key)
        return lib

    try:
        _autocast_lib = _register_autocast()  # kept: a Library unregisters its kernels when collected
    except (AttributeError, RuntimeError):  # private dispatcher API moved: the wrapper's cast still applies
        _autocast_lib = None

    def _call_forward(*args):
        return forward_op(*args)

else:  # torch < 2.4: an autograd.Function (eager only, no torch.compile support)

    class _NSAFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = _forward_impl(*inputs)
            _save_forward(ctx, inputs, output)
            ctx.mark_non_differentiable(*output[1:])
            return output

        @staticmethod
        def backward(ctx, grad_o, *unused):
            saved, n = ctx.saved_tensors, ctx.n_tensors
            return _grads_to_inputs(ctx, _backward_impl(grad_o, *saved[:n], *saved[n:], *ctx.cfg))

    def _call_forward(*args):
        return _NSAFunction.apply(*args)


# ---- autocast and the public entry ---------------------------------------------------------------

if hasattr(torch, "get_autocast_dtype"):
    def autocast_dtype(device_type):
        """The autocast dtype active for device_type, or None."""
        if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
else:
    def autocast_dtype(device_type):
        if device_type == "cuda":
            return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        return None


def _check_rank(x, name, rank):
    if x.dim() != rank:
        raise NsaError(_lib.STATUS_BAD_RANK, "%s must have rank %d, got shape %s" % (name, rank, tuple(x.shape)))


def _index_tensor(x, device, name):
    if x is None:
        return None
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x)
    if x.is_floating_point() or x.is_complex():
        raise NsaError(_lib.STATUS_BAD_DTYPE, "%s must be an integer tensor, got %s" % (name, x.dtype))
    return x.to(device=device, dtype=torch.int32)


def native_sparse_attention(q, k, v, g_cmp, g_slc, g_swa, config, k_cmp=None, v_cmp=None, block_indices=None,
                            block_counts=None, cu_seqlens=None, k_slc=None, v_slc=None, k_swa=None, v_swa=None,
                            return_aux=False):
    """Torch path of nsa.native_sparse_attention (see its docstring)."""
    _check_rank(q, "q", 4)
    _check_rank(k, "k", 4)
    _check_rank(v, "v", 4)
    cast_to = autocast_dtype(q.device.type)

    def cast(x, dtype):
        if x is None or not x.is_floating_point() or x.dtype == dtype:
            return x
        return x.to(dtype)

    if cast_to is not None:
        q, k, v, k_cmp, v_cmp, k_slc, v_slc, k_swa, v_swa = [
            cast(x, cast_to) for x in (q, k, v, k_cmp, v_cmp, k_slc, v_slc, k_swa, v_swa)]
    # Gates follow q's dtype, as in fla where they only scale the branch outputs.
    g_cmp, g_slc, g_swa = [cast(g, q.dtype) for g in (g_cmp, g_slc, g_swa)]
    block_indices = _index_tensor(block_indices, q.device, "block_indices")
    block_counts = _index_tensor(block_counts, q.device, "block_counts")
    if cu_seqlens is not None and not isinstance(cu_seqlens, Tensor):
        cu_seqlens = torch.tensor(_core.cu_seqlens_list(cu_seqlens), dtype=torch.int32)
    out = _call_forward(q, k, v, k_cmp, v_cmp, k_slc, v_slc, k_swa, v_swa, g_cmp, g_slc, g_swa,
                        block_indices, block_counts, cu_seqlens, *_core.config_tuple(config))
    if not return_aux:
        return out[0]
    present = _saved_present(dict(g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, block_indices=block_indices))
    aux = _core.Aux(*[t.detach() if present[name] else None for name, t in zip(_core.SAVED, out[1:])])
    return out[0], aux


def fla_selection(q, k, config, counts, cu_seqlens):
    """fla's selection for per-query block_counts [B, T, H] (see nsa.parallel_nsa): for each
    distinct count c the top-max(c, n_init + n_local) blocks, padded to the widest with -1;
    returns (block_indices, block_counts) int32 on q's device. Eager only (data dependent)."""
    with torch.no_grad():
        cast_to = autocast_dtype(q.device.type)
        if cast_to is not None:
            q, k = q.to(cast_to), k.to(cast_to)
        q, k = q.detach(), k.detach()
        counts = _index_tensor(counts, q.device, "block_counts")
        call = TorchCall(q.device)
        k_cmp = _core.compress(call, k, config, cu_seqlens)
        forced = config.n_init + config.n_local
        values = sorted(set(counts.clamp(min=0).unique().tolist()))
        width = max([forced] + values)
        B, T, H = counts.shape
        merged = torch.full((B, T, H, width), -1, dtype=torch.int32, device=q.device)
        for c in values:
            n = max(c, forced)
            cfg = dataclasses.replace(config, slc_topk=n)
            idx = _core.select(TorchCall(q.device), q, k_cmp, cfg, cu_seqlens=cu_seqlens)
            pad = torch.full((B, T, H, width), -1, dtype=torch.int32, device=q.device)
            pad[..., :n] = idx
            merged = torch.where((counts == c).unsqueeze(-1), pad, merged)
        return merged, counts


# ---- nsa.attention with autograd (and torch.compile) ----------------------------------------

# Optional tensors and scalars of nsa.attention's options, in the custom ops' argument order.
_ATT_TENSORS = ("sinks", "bias", "mask", "q_segment_ids", "k_segment_ids", "cu_seqlens", "cu_seqlens_q",
                "cu_seqlens_k")
_ATT_SCALARS = ("causal", "window_left", "window_right", "scale", "softcap", "dropout_p", "seed", "offset")


def _att_args(opts):
    """opts -> (optional tensors, scalars) of the custom ops; cu_seqlens lists become int32 CPU
    tensors (the library reads them on the host)."""
    ts = []
    for name in _ATT_TENSORS:
        x = opts.get(name)
        if x is not None and name.startswith("cu_seqlens") and not isinstance(x, Tensor):
            x = torch.tensor(_core.cu_seqlens_list(x), dtype=torch.int32)
        ts.append(x)
    wl, wr = opts.get("window", (-1, -1))
    sc = (bool(opts.get("causal")), int(wl), int(wr), float(opts.get("scale") or 0.0), float(opts.get("softcap") or 0.0),
          float(opts.get("dropout_p") or 0.0), int(opts.get("seed") or 0), int(opts.get("offset") or 0))
    return ts, sc


def _att_opts(ts, sc):
    """The inverse of _att_args: the options dict _core reads."""
    opts = dict(zip(_ATT_TENSORS, ts))
    causal, wl, wr, scale, softcap, dropout_p, seed, offset = sc
    opts.update(causal=causal, window=(wl, wr), scale=scale, softcap=softcap, dropout_p=dropout_p, seed=seed,
                offset=offset)
    return opts


def _att_fwd_impl(q, k, v, ts, sc):
    return _core.attention(TorchCall(q.device), q, k, v, _att_opts(ts, sc))


def _att_bwd_impl(dout, q, k, v, o, lse, ts, sc, want_dbias):
    g = _core.attention_backward(TorchCall(q.device), q, k, v, o, lse, dout, _att_opts(ts, sc), dbias=want_dbias)
    def empty():  # a fresh one per absent output: custom-op outputs may not alias each other
        return torch.empty((0,), dtype=torch.float32, device=q.device)
    return g.dq, g.dk, g.dv, g.dsinks if g.dsinks is not None else empty(), g.dbias if g.dbias is not None else empty()


def _att_grads(ctx, g, bias):
    """(dq, dk, dv, dsinks, dbias) -> the gradients of (q, k, v, sinks, bias)."""
    dq, dk, dv, dsinks, dbias = g
    return (dq, dk, dv, dsinks if ctx.want_sinks else None,
            dbias.to(bias.dtype) if ctx.want_bias else None)


def _att_save(ctx, q, k, v, o, lse, ts, sc):
    """What both backwards read: q, k, v, o, lse and the optional tensors saved (None where absent;
    a write into one before the backward is an error), the scalars, and whether sinks (input 3)
    and bias (input 4) want gradients."""
    ctx.sc = tuple(sc)
    ctx.want_sinks, ctx.want_bias = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
    ctx.save_for_backward(q, k, v, o, lse, *ts)
    ctx.mark_non_differentiable(lse)


def _att_saved(ctx, grad_o):
    """(dout in o's dtype, q, k, v, o, lse, the optional tensors) as _att_save left them."""
    saved = ctx.saved_tensors
    o = saved[3]
    return (grad_o if grad_o.dtype == o.dtype else grad_o.to(o.dtype),) + tuple(saved[:5]) + (tuple(saved[5:]),)


class _AttentionFunction(torch.autograd.Function):
    """nsa_attention forward / nsa_attention_bwd backward; sinks and bias come in as inputs so
    that autograd hands their gradients back (dsinks float32 [HQ], dbias in bias's dtype and
    shape, summed over the broadcast dimensions by the library); lse has no gradient. The eager
    path (the custom ops' dispatch costs a few hundred microseconds a forward and backward, a
    small call's whole budget), and torch < 2.4's only one."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, bias, ts, sc):
        o, lse = _att_fwd_impl(q, k, v, ts, sc)
        _att_save(ctx, q, k, v, o, lse, ts, sc)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        dout, q, k, v, o, lse, ts = _att_saved(ctx, grad_o)
        g = _att_bwd_impl(dout, q, k, v, o, lse, ts, ctx.sc, ctx.want_bias)
        return _att_grads(ctx, g, ts[1]) + (None, None)


if HAS_CUSTOM_OP:
    @torch.library.custom_op("nsa::attention", mutates_args=())
    def attention_op(q: Tensor, k: Tensor, v: Tensor,
                     sinks: Optional[Tensor], bias: Optional[Tensor], mask: Optional[Tensor],
                     q_segment_ids: Optional[Tensor], k_segment_ids: Optional[Tensor],
                     cu_seqlens: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                     causal: bool, window_left: int, window_right: int, scale: float, softcap: float,
                     dropout_p: float, seed: int, offset: int) -> Tuple[Tensor, Tensor]:
        return _att_fwd_impl(q, k, v, (sinks, bias, mask, q_segment_ids, k_segment_ids, cu_seqlens, cu_seqlens_q,
                                        cu_seqlens_k),
                             (causal, window_left, window_right, scale, softcap, dropout_p, seed, offset))

    @attention_op.register_fake
    def _(q, k, v, *rest):
        B, Tq, HQ = q.shape[0], q.shape[1], q.shape[2]
        return q.new_empty((B, Tq, HQ, v.shape[3])), q.new_empty((B, Tq, HQ), dtype=torch.float32)

    @torch.library.custom_op("nsa::attention_bwd", mutates_args=())
    def attention_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                         sinks: Optional[Tensor], bias: Optional[Tensor], mask: Optional[Tensor],
                         q_segment_ids: Optional[Tensor], k_segment_ids: Optional[Tensor],
                         cu_seqlens: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                         causal: bool, window_left: int, window_right: int, scale: float, softcap: float,
                         dropout_p: float, seed: int, offset: int, want_dbias: bool
                         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """dq, dk, dv, dsinks (float32 [HQ], empty without sinks), dbias (float32 like bias,
        empty unless want_dbias)."""
        return _att_bwd_impl(dout, q, k, v, o, lse,
                             (sinks, bias, mask, q_segment_ids, k_segment_ids, cu_seqlens, cu_seqlens_q, cu_seqlens_k),
                             (causal, window_left, window_right, scale, softcap, dropout_p, seed, offset), want_dbias)

    @attention_bwd_op.register_fake
    def _(dout, q, k, v, o, lse, sinks, bias, *rest):
        want_dbias = rest[-1]
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                sinks.new_empty(sinks.shape, dtype=torch.float32) if sinks is not None
                else q.new_empty((0,), dtype=torch.float32),
                bias.new_empty(bias.shape, dtype=torch.float32) if (want_dbias and bias is not None)
                else q.new_empty((0,), dtype=torch.float32))

    _N_ATT_IN = 3 + len(_ATT_TENSORS)

    def _att_setup_context(ctx, inputs, output):
        _att_save(ctx, *inputs[:3], *output, inputs[3:_N_ATT_IN], inputs[_N_ATT_IN:])

    def _att_backward(ctx, grad_o, grad_lse):
        dout, q, k, v, o, lse, ts = _att_saved(ctx, grad_o)
        g = attention_bwd_op(dout, q, k, v, o, lse, *ts, *ctx.sc, ctx.want_bias)
        return _att_grads(ctx, g, ts[1]) + (None,) * (len(_ATT_TENSORS) - 2 + len(_ATT_SCALARS))

    attention_op.register_autograd(_att_backward, setup_context=_att_setup_context)

    def attention(q, k, v, opts):
        """(o, lse) of nsa_attention through torch.ops.nsa.attention (autograd and torch.compile),
        or in plain eager calls the same functions through _AttentionFunction."""
        ts, sc = _att_args(opts)
        if plain_eager(q, k, v, *(t for t in ts if t is not None)):
            return _AttentionFunction.apply(q, k, v, ts[0], ts[1], ts, sc)
        return attention_op(q, k, v, *ts, *sc)

else:  # torch < 2.4: the autograd.Function (eager only)

    def attention(q, k, v, opts):
        """(o, lse) of nsa_attention with autograd."""
        ts, sc = _att_args(opts)
        return _AttentionFunction.apply(q, k, v, ts[0], ts[1], ts, sc)


def attention_needs_grad(q, k, v, opts):
    """Whether nsa.attention should record autograd: grad mode on and some differentiable input
    (q, k, v, sinks, bias) requires a gradient."""
    if not torch.is_grad_enabled():
        return False
    return any(x is not None and x.requires_grad for x in (q, k, v, opts.get("sinks"), opts.get("bias")))


# ---- the inference steps as custom ops (torch.compile; CUDA graphs capture their kernels) ------

_dispatch_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)


def plain_eager(*tensors):
    """Whether a call may reach the library directly instead of through its custom op: plain
    tensors (no subclass, no fake or functional tensor), no torch.compile or jit trace, no
    dispatch mode. The op's dispatch costs tens of microseconds a call, a decode step's budget;
    the direct call runs the same code (a CUDA graph captures the same kernels)."""
    # is_compiling first: under dynamo it is a constant and the rest is not traced
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _dispatch_depth is None or _dispatch_depth() != 0:
        return False
    return all(t is None or type(t) is Tensor for t in tensors)


def bump_versions(*tensors):
    """What the custom op's mutates_args does for the caches a direct call appended to: their
    version counters move, so autograd sees the in-place write."""
    for t in tensors:
        if t is not None:
            torch.autograd.graph.increment_version(t)


# ---- the decode loop's direct path -----------------------------------------------------------
# A decode loop calls a step with tensors of the same layouts every time (the same caches and
# tables, and a fresh query, new tokens and gates of the same shapes); at small batches the
# Python work of a call (views, the workspace query, a dozen checks) is most of an eager step.
# The first call of a set of layouts takes the full path below and keeps the argument struct it
# built and the workspace size; a later call whose inputs have the same shapes, strides, dtypes,
# devices and 16-byte alignment -- so the same checks' verdicts, kernels and workspace, the
# struct differing in its data pointers only -- copies that struct, writes its tensors' and
# fresh outputs' pointers into it and calls the library itself, which validates it as always.

class _Recorder(TorchCall):
    """A TorchCall that keeps what a later direct call replays: the argument struct, the
    workspace size, and whether every input was used in place (no copy, no reinterpreting view:
    the struct then points at the caller's own tensors)."""

    def __init__(self, device):
        super().__init__(device)
        self.in_place, self.args, self.nbytes = True, None, 0

    def view(self, t, name, output=False):
        v = super().view(t, name, output)
        if not output and self.keep[-1] is not t:
            self.in_place = False
        return v

    def workspace(self, nbytes):
        self.nbytes = nbytes
        return super().workspace(nbytes)

    def run(self, op, args):
        self.args = args
        return super().run(op, args)


_PREPARED = {}  # (op, scalars, device, stream, layout of each input) -> _Prepared
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _data_offset(struct_type, path):
    """Byte offset of the data pointer of the nsa_tensor at `path` ("cache.k") in struct_type."""
    off = 0
    for name in path.split("."):
        field = getattr(struct_type, name)
        off += field.offset
        struct_type = dict(struct_type._fields_)[name]
    return off + _lib.Tensor.data.offset


@dataclasses.dataclass
class _Prepared:
    struct: bytes        # the argument struct of the recorded call
    args_type: type
    inputs: tuple        # (byte offset of its data pointer, index into the call's inputs) per present input
    outs: tuple          # per output in return order: (byte offset, shape, dtype), or None (not asked for)
    fn: object           # nsa_<op>
    op: str
    ctx: object          # the context handle of the device and stream
    nbytes: int


def _layout(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15)


def _direct_key(op, tensors, scalars, device):
    """The direct path's key of a CUDA call on the current device, or None (another device
    current, or no raw-stream query in this torch)."""
    current = torch.cuda.current_device()
    index = device.index if device.index is not None else current
    if _raw_stream is None or current != index:
        return None
    return (op, scalars, index, _raw_stream(index)) + tuple(map(_layout, tensors))


def _direct_run(key, tensors):
    """The outputs of a replayed call (None where not asked for), or None when no call of these
    layouts was recorded."""
    p = _PREPARED.get(key)
    if p is None:
        return None
    buf = bytearray(p.struct)
    for off, i in p.inputs:
        _pack_into("P", buf, off, tensors[i].data_ptr())
    device = tensors[0].device
    outs = []
    for out in p.outs:
        t = None
        if out is not None:
            t = torch.empty(out[1], dtype=out[2], device=device)
            _pack_into("P", buf, out[0], t.data_ptr())
        outs.append(t)
    ws = torch.empty(p.nbytes, dtype=torch.uint8, device=device) if p.nbytes else None
    args = ctypes.byref(p.args_type.from_buffer(buf))
    _core._check(p.fn(p.ctx, args, None if ws is None else ws.data_ptr(), p.nbytes), p.op)
    return outs


def _direct_record(key, tensors, fields, rec, op, outs):
    """Keeps a recorded call (rec: the _Recorder that ran it; fields: the struct path of each
    input; outs: (struct path, tensor or None) of each output) for later direct calls."""
    if key is None or not rec.in_place or rec.args is None:
        return
    if len(_PREPARED) >= 64:
        _PREPARED.clear()
    at = type(rec.args)
    inputs = tuple((_data_offset(at, f), i) for i, (f, t) in enumerate(zip(fields, tensors)) if t is not None)
    outs = tuple(None if t is None else (_data_offset(at, f), t.shape, t.dtype) for f, t in outs)
    _PREPARED[key] = _Prepared(bytes(rec.args), at, inputs, outs, getattr(_core._L, "nsa_" + op), op, rec.context(),
                               rec.nbytes)


def _direct_call(op, q, tensors, scalars, fields, names, full):
    """The outputs `names` of op (None where not asked for): replayed when a call of these
    layouts was recorded, else from full(rec), the full path through a _Recorder, and recorded.
    tensors: the inputs, in the order of fields (their struct paths)."""
    key = _direct_key(op, tensors, scalars, q.device) if q.is_cuda else None
    out = _direct_run(key, tensors) if key is not None else None
    if out is None:
        rec = _Recorder(q.device)
        out = full(rec)
        _direct_record(key, tensors, fields, rec, op, tuple(zip(names, out)))
    return out


_STEP_FIELDS = ("q", "cache.k", "cache.v", "cache.block_table", "seqlens", "q_lens", "k_new", "v_new", "cmp_cache.k",
                "cmp_cache.v", "cmp_cache.block_table", "g_cmp", "g_slc", "g_swa", "block_indices", "block_counts")
_ATTENTION_STEP_FIELDS = ("q", "cache.k", "cache.v", "cache.block_table", "seqlens", "q_lens", "k_new", "v_new",
                          "sinks")


def _step_impl(q, cache_k, cache_v, block_table, seqlens, q_lens, k_new, v_new, cmp_k, cmp_v, cmp_table, cmp_by_caller,
               g_cmp, g_slc, g_swa, block_indices, block_counts, cfg, want_selected):
    cache = (cache_k, cache_v, block_table)
    cmp_cache = None if cmp_k is None else (cmp_k, cmp_v, cmp_table)
    o, selected, errors = _core.step(TorchCall(q.device), q, cache, seqlens, _core.Config(*cfg), q_lens, k_new, v_new,
                                     cmp_cache, cmp_by_caller, (g_cmp, g_slc, g_swa), block_indices, block_counts,
                                     want_selected, True)
    return o, selected if selected is not None else _empty(q, torch.int32), errors


def _step_fake(q, cache_v, seqlens, g_slc, block_indices, cfg, want_selected):
    B, Tq, HQ = q.shape[0], q.shape[1], q.shape[2]
    H = cache_v.shape[2]
    sel = (q.new_empty((B, Tq, H, cfg[3]), dtype=torch.int32) if want_selected and g_slc is not None and block_indices is None
           else _empty(q, torch.int32))
    return q.new_empty((B, Tq, HQ, cache_v.shape[3])), sel, seqlens.new_empty((B,), dtype=torch.int32)


def _attention_step_impl(q, cache_k, cache_v, block_table, seqlens, q_lens, k_new, v_new, sinks, scale, causal,
                         window_left, window_right, softcap):
    o, lse, errors = _core.attention_step(TorchCall(q.device), q, (cache_k, cache_v, block_table), seqlens, q_lens,
                                          k_new, v_new, scale, causal, (window_left, window_right), softcap, sinks,
                                          True, True)
    return o, lse, errors


if HAS_CUSTOM_OP:
    @torch.library.custom_op("nsa::step", mutates_args=("cache_k", "cache_v", "cmp_k", "cmp_v"))
    def step_op(q: Tensor, cache_k: Tensor, cache_v: Tensor, block_table: Optional[Tensor], seqlens: Tensor,
                q_lens: Optional[Tensor], k_new: Optional[Tensor], v_new: Optional[Tensor], cmp_k: Optional[Tensor],
                cmp_v: Optional[Tensor], cmp_table: Optional[Tensor], cmp_by_caller: bool, g_cmp: Optional[Tensor],
                g_slc: Optional[Tensor], g_swa: Optional[Tensor], block_indices: Optional[Tensor],
                block_counts: Optional[Tensor], cmp_len: int, cmp_stride: int, slc_block: int, slc_topk: int,
                n_init: int, n_local: int, window: int, scale: float, swa_scale: float,
                want_selected: bool) -> Tuple[Tensor, Tensor, Tensor]:
        cfg = (cmp_len, cmp_stride, slc_block, slc_topk, n_init, n_local, window, scale, swa_scale)
        return _step_impl(q, cache_k, cache_v, block_table, seqlens, q_lens, k_new, v_new, cmp_k, cmp_v, cmp_table,
                          cmp_by_caller, g_cmp, g_slc, g_swa, block_indices, block_counts, cfg, want_selected)

    @step_op.register_fake
    def _(q, cache_k, cache_v, block_table, seqlens, q_lens, k_new, v_new, cmp_k, cmp_v, cmp_table, cmp_by_caller,
          g_cmp, g_slc, g_swa, block_indices, block_counts, *rest):
        return _step_fake(q, cache_v, seqlens, g_slc, block_indices, rest[:9], rest[9])

    @torch.library.custom_op("nsa::attention_step", mutates_args=("cache_k", "cache_v"))
    def attention_step_op(q: Tensor, cache_k: Tensor, cache_v: Tensor, block_table: Optional[Tensor], seqlens: Tensor,
                          q_lens: Optional[Tensor], k_new: Optional[Tensor], v_new: Optional[Tensor],
                          sinks: Optional[Tensor], scale: float, causal: bool, window_left: int, window_right: int,
                          softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
        return _attention_step_impl(q, cache_k, cache_v, block_table, seqlens, q_lens, k_new, v_new, sinks, scale, causal,
                                    window_left, window_right, softcap)

    @attention_step_op.register_fake
    def _(q, cache_k, cache_v, block_table, seqlens, *rest):
        B, Tq, HQ = q.shape[0], q.shape[1], q.shape[2]
        return (q.new_empty((B, Tq, HQ, cache_v.shape[3])), q.new_empty((B, Tq, HQ), dtype=torch.float32),
                seqlens.new_empty((B,), dtype=torch.int32))

    def _ints_on(q):
        """int32 index tensors on q's device from tensors, lists or numpy (the usual case, an
        int32 tensor already there, without a conversion call)."""
        index = q.get_device()

        def ints(x, name):
            if type(x) is Tensor and x.dtype is torch.int32 and x.get_device() == index:
                return x
            return _index_tensor(x, q.device, name)
        return ints

    def call_step(q, cache, seqlens, config, q_lens, k_new, v_new, cmp_cache, cmp_by_caller, gates, block_indices,
                  block_counts, want_selected, want_errors=True):
        """(o, selected, errors) of nsa.step; selected / errors None when not asked for on the
        direct path (the custom op always returns both, empty when absent)."""
        ints = _ints_on(q)
        bt = ints(cache[2], "cache.block_table") if len(cache) == 3 else None
        ck, cv, ct = (None, None, None) if cmp_cache is None else (
            cmp_cache[0], cmp_cache[1], ints(cmp_cache[2], "cmp_cache.block_table") if len(cmp_cache) == 3 else None)
        args = (q, cache[0], cache[1], bt, ints(seqlens, "seqlens"), ints(q_lens, "q_lens"), k_new, v_new, ck, cv, ct,
                bool(cmp_by_caller), gates[0], gates[1], gates[2], ints(block_indices, "block_indices"),
                ints(block_counts, "block_counts"))
        cfg = _core.config_tuple(config)
        if not plain_eager(q, cache[0], cache[1], k_new, v_new, ck, cv):
            return step_op(*args, *cfg, bool(want_selected))
        o, selected, errors = _direct_call(
            "step", q, args[:11] + args[12:], (args[11], cfg, bool(want_selected), bool(want_errors)), _STEP_FIELDS,
            ("o", "selected", "errors"),
            lambda rec: _core.step(rec, q, (cache[0], cache[1], bt), args[4], _core.Config(*cfg), args[5], k_new, v_new,
                                   None if ck is None else (ck, cv, ct), args[11], gates, args[15], args[16],
                                   want_selected, want_errors))
        if k_new is not None:
            bump_versions(cache[0], cache[1], *((ck, cv) if not cmp_by_caller else ()))
        return o, selected, errors

    def call_attention_step(q, cache, seqlens, q_lens, k_new, v_new, scale, causal, window, softcap, sinks,
                            want_lse=True, want_errors=True):
        """(o, lse, errors) of nsa.attention_step; lse / errors None when not asked for on the
        direct path."""
        ints = _ints_on(q)
        bt = ints(cache[2], "cache.block_table") if len(cache) == 3 else None
        args = (q, cache[0], cache[1], bt, ints(seqlens, "seqlens"), ints(q_lens, "q_lens"), k_new, v_new, sinks,
                float(scale or 0.0), bool(causal), int(window[0]), int(window[1]), float(softcap or 0.0))
        if not plain_eager(q, cache[0], cache[1], k_new, v_new, sinks):
            return attention_step_op(*args)
        o, lse, errors = _direct_call(
            "attention_step", q, args[:9], args[9:] + (bool(want_lse), bool(want_errors)), _ATTENTION_STEP_FIELDS,
            ("o", "lse", "errors"),
            lambda rec: _core.attention_step(rec, q, (cache[0], cache[1], bt), args[4], args[5], k_new, v_new, args[9],
                                             args[10], (args[11], args[12]), args[13], sinks, want_lse, want_errors))
        if k_new is not None:
            bump_versions(cache[0], cache[1])
        return o, lse, errors
else:
    call_step = call_attention_step = None
