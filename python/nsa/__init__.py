"""nsa -- Native Sparse Attention (DeepSeek, arXiv 2502.11089), Python binding of the C library.

The shared library is found next to this package, in the repository's build/ folder, or
through the NSA_LIBRARY environment variable. Loading it has no other dependency: numpy is
needed for numpy arrays, PyTorch for tensors (then the ops are torch custom ops with autograd,
fake implementations for torch.compile, and autocast support).

    o = nsa.parallel_nsa(q, k, v, g_cmp, g_slc, g_swa, block_counts=16, block_size=64,
                         window_size=512)              # the call of fla.ops.nsa.parallel_nsa
    o = nsa.native_sparse_attention(q, k, v, g_cmp, g_slc, g_swa, config=nsa.Config())

Shapes: q [B, T, HQ, DK], k [B, T, H, DK], v [B, T, H, DV], gates [B, T, HQ], o [B, T, HQ, DV];
what is computed is spec/nsa.md, the conventions those of include/nsa.h.
"""
from __future__ import annotations  # (the annotations below stay strings: no cost, Python 3.8)

import importlib.util
import os
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from . import _core, _lib
from ._core import AttentionGrads, Aux, Config, Grads, NsaError, cmp_offsets, status_name, status_string
from ._lib import library
from .cache import KVCache

__all__ = ["__version__", "library", "version", "status_string", "status_name", "backend_available", "NsaError", "Config",
           "Aux", "Grads", "Result", "native_sparse_attention", "parallel_nsa", "forward", "compress", "select",
           "cmp_offsets", "torch_available", "attention", "AttentionResult", "AttentionGrads", "step", "attention_step", "flex_attention", "create_block_mask", "BlockMask",
           "KVCache"]

# An array: a numpy.ndarray (CPU backend) or a torch.Tensor (its device's backend).
Array = Any
# cu_seqlens: a list, array or tensor of num_seqs + 1 ints.
Offsets = Union[Sequence[int], Array]

# With PyTorch installed the custom ops are registered at import, before any torch.compile
# traces a call (NSA_NO_TORCH=1 skips that, e.g. for a numpy-only process).
def _torch_installed():
    if os.environ.get("NSA_NO_TORCH") == "1":
        return False
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # sys.modules["torch"] set to None: treated as absent
        return False


if _torch_installed():
    from . import _torch  # (no `_torch = None` before this: the import would then find that attribute)
else:
    _torch = None


def version() -> str:
    """The linked C library's version, "MAJOR.MINOR.PATCH"."""
    return library.nsa_version_string().decode()


__version__ = version()  # the package and the C library share one version (include/nsa.h)


def backend_available(name: str) -> bool:
    """True when backend "cpu" or "cuda" is compiled in and usable here."""
    codes = {"cpu": _lib.BACKEND_CPU, "cuda": _lib.BACKEND_CUDA}
    if name not in codes:
        raise ValueError("backend must be 'cpu' or 'cuda', not %r" % (name,))
    return bool(library.nsa_backend_available(codes[name]))


def torch_available() -> bool:
    """True when the PyTorch integration (torch.ops.nsa.*) is loaded."""
    return _torch is not None


def __getattr__(name):  # `nsa.nn` imports torch, so it loads on first use
    if name == "nn":
        import importlib
        return importlib.import_module(".nn", __name__)
    if name == "BlockMask":
        from .flex import BlockMask
        return BlockMask
    raise AttributeError("module 'nsa' has no attribute %r" % (name,))


def _is_torch(x):
    # no sys.modules look-up here: this runs inside torch.compile traces
    return _torch is not None and isinstance(x, _torch.Tensor)


def _as_int32(x):
    if _is_torch(x):
        return x if x.is_floating_point() or x.dtype == _torch.torch.int32 else x.to(_torch.torch.int32)
    import numpy as np
    x = np.asarray(x)
    return x.astype(np.int32) if x.dtype.kind in "iu" and x.dtype != np.int32 else x


def _call_for(q):
    if _is_torch(q):
        if _torch is None:
            raise RuntimeError("nsa: torch tensors given but the torch integration is not loaded (NSA_NO_TORCH=1?)")
        return _torch.TorchCall(q.device)
    return _core.NumpyCall()


# ---- no-autograd calls, numpy or torch ----------------------------------------------------------


class Result:
    """What nsa.forward returns: .o, .aux (an Aux), and .backward(dout) -> Grads."""

    def __init__(self, q, tensors, config, cu_seqlens, o, saved):
        self._q = q
        self._tensors = tensors
        self._config = config
        self._cu = cu_seqlens
        self._saved = saved
        self.o = o
        self.aux = Aux(*(saved.get(name) for name in _core.SAVED))

    def backward(self, dout):
        """nsa_backward: gradients of every given input (gradients are overwritten, never
        accumulated; selection carries none)."""
        grads = _core.backward(_call_for(self._q), self._tensors, self._saved, self._config, self._cu, dout)
        return Grads(*(grads.get(name) for name in _core.GRADS))


def forward(q: Array, k: Array, v: Array, g_cmp: Optional[Array] = None, g_slc: Optional[Array] = None,
            g_swa: Optional[Array] = None, config: Optional[Config] = None, k_cmp: Optional[Array] = None,
            v_cmp: Optional[Array] = None, block_indices: Optional[Array] = None, block_counts: Optional[Array] = None,
            cu_seqlens: Optional[Offsets] = None, k_slc: Optional[Array] = None, v_slc: Optional[Array] = None,
            k_swa: Optional[Array] = None, v_swa: Optional[Array] = None, out: Optional[Array] = None) -> Result:
    """nsa_forward on numpy arrays (CPU backend) or torch tensors (no autograd: use
    native_sparse_attention for that). Returns a Result; Result.backward(dout) runs
    nsa_backward. `out` (optional) receives o; on any error it is left untouched.
    Saved branch outputs are float32 (see native_sparse_attention)."""
    config = _core._as_config(config)
    tensors = dict(q=q, k=k, v=v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, k_cmp=k_cmp, v_cmp=v_cmp,
                   k_slc=k_slc, v_slc=v_slc, k_swa=k_swa, v_swa=v_swa, block_indices=block_indices,
                   block_counts=block_counts)
    tensors = {n: x for n, x in tensors.items() if x is not None}
    for name in ("block_indices", "block_counts"):  # fla passes int64 indices; C reads int32
        if name in tensors:
            tensors[name] = _as_int32(tensors[name])
    o, saved = _core.forward(_call_for(q), tensors, config, cu_seqlens, out=out)
    return Result(q, tensors, config, cu_seqlens, o, saved)


def step(q: Array, cache: Sequence[Array], seqlens: Array, config: Optional[Config] = None, *,
         q_lens: Optional[Array] = None, k_new: Optional[Array] = None, v_new: Optional[Array] = None,
         cmp_cache: Optional[Sequence[Array]] = None, cmp_by_caller: bool = False, g_cmp: Optional[Array] = None,
         g_slc: Optional[Array] = None, g_swa: Optional[Array] = None, block_indices: Optional[Array] = None,
         block_counts: Optional[Array] = None, return_selected: bool = False,
         return_errors: bool = False) -> Union[Array, Tuple[Array, Optional[Array], Optional[Array]]]:
    """One inference step of NSA against KV caches (nsa_step, spec 12): decode, a multi-token
    step or a chunk of a chunked prefill, numpy arrays (CPU) or torch tensors (CPU or CUDA,
    the current stream; no autograd).

    q [B, Tq, HQ, DK]: the step's queries; q_lens [B] int32: how many of them sequence b has
    (default Tq each). seqlens [B] int32: tokens cached before the step. cache: (k, v) with
    k [B, cap, H, DK] (contiguous) or (k, v, block_table) with k [num_pages, page_size, H, DK]
    and block_table [B, max_pages] int32 (paged). k_new, v_new [B, Tq, H, DK/DV]: the step's
    tokens, appended in place at rows seqlens[b] ..; without them the caches already hold the
    step's tokens (its queries are the last q_lens[b] of seqlens[b]). cmp_cache: the compressed
    K/V in the same two forms (needed with g_cmp or a computed selection): the step pools the
    rows its tokens complete into it, or, with cmp_by_caller, only reads it. Gates, config,
    block_indices / block_counts as native_sparse_attention. Query i of sequence b gets row
    seqlens-after - q_lens[b] + i of nsa_forward over the whole cached sequence.

    Returns o [B, Tq, HQ, DV] (rows past q_lens[b] are 0), and (o, selected, errors) when
    return_selected / return_errors ask for the selection [B, Tq, H, n] (-1 past q_lens[b]) and
    the per-sequence codes (nsa.h nsa_step_error; the CUDA backend reports a bad length or page
    there and skips that sequence, its rows of o zero; the CPU raises NsaError before writing
    anything)."""
    config = _core._as_config(config)
    ints = [None if x is None else _as_int32(x) for x in (seqlens, q_lens, block_indices, block_counts)]
    if cache is not None and len(cache) == 3 and cache[2] is not None:
        cache = (cache[0], cache[1], _as_int32(cache[2]))
    if cmp_cache is not None and len(cmp_cache) == 3 and cmp_cache[2] is not None:
        cmp_cache = (cmp_cache[0], cmp_cache[1], _as_int32(cmp_cache[2]))
    if _is_torch(q) and _torch.call_step is not None:  # the custom op: torch.compile traces it, graphs capture it
        o, selected, errors = _torch.call_step(q, cache, ints[0], config, ints[1], k_new, v_new, cmp_cache,
                                               cmp_by_caller, (g_cmp, g_slc, g_swa), ints[2], ints[3], return_selected,
                                               return_errors)
        selected = selected if selected is not None and selected.dim() == 4 else None
        errors = errors if return_errors else None
    else:
        o, selected, errors = _core.step(_call_for(q), q, cache, ints[0], config, ints[1], k_new, v_new, cmp_cache,
                                         cmp_by_caller, (g_cmp, g_slc, g_swa), ints[2], ints[3], return_selected,
                                         return_errors)
    if return_selected or return_errors:
        return o, selected, errors
    return o


def attention_step(q: Array, cache: Sequence[Array], seqlens: Array, *, q_lens: Optional[Array] = None,
                   k_new: Optional[Array] = None, v_new: Optional[Array] = None, causal: bool = True,
                   window: Tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: Optional[Array] = None,
                   scale: Optional[float] = None, return_lse: bool = False,
                   return_errors: bool = False) -> Union[Array, Tuple[Array, Optional[Array], Optional[Array]]]:
    """One inference step of dense attention against a KV cache (nsa_attention_step, spec 12.1):
    the caches, lengths and append of nsa.step, the function of nsa.attention. Query i of
    sequence b is the token at position p = L_b - q_lens[b] + i (L_b its tokens after the
    append) and sees cached key j < L_b iff window[0] < 0 or j >= p - window[0], and j <= p when
    causal, else window[1] < 0 or j <= p + window[1]. softcap, sinks [HQ] float32 and scale as
    nsa.attention. Returns o [B, Tq, HQ, DV] (rows past q_lens[b] are 0), and (o, lse, errors)
    when return_lse / return_errors ask for lse [B, Tq, HQ] float32 (-inf past q_lens[b]) and the
    per-sequence codes."""
    ints = [None if x is None else _as_int32(x) for x in (seqlens, q_lens)]
    if cache is not None and len(cache) == 3 and cache[2] is not None:
        cache = (cache[0], cache[1], _as_int32(cache[2]))
    if _is_torch(q) and _torch.call_attention_step is not None:
        o, lse, errors = _torch.call_attention_step(q, cache, ints[0], ints[1], k_new, v_new, scale, causal, window,
                                                    softcap, sinks, return_lse, return_errors)
        lse, errors = (lse if return_lse else None), (errors if return_errors else None)
    else:
        o, lse, errors = _core.attention_step(_call_for(q), q, cache, ints[0], ints[1], k_new, v_new, scale or 0.0, causal,
                                              window, softcap, sinks, return_lse, return_errors)
    if return_lse or return_errors:
        return o, lse, errors
    return o


def compress(x: Array, config: Optional[Config] = None, cu_seqlens: Optional[Offsets] = None) -> Array:
    """nsa_compress (the default phi, mean over overlapping blocks): x [B, T, H, D] ->
    [B, Nc, H, D] (packed rows under cu_seqlens). No autograd."""
    return _core.compress(_call_for(x), x, _core._as_config(config), cu_seqlens)


def select(q: Array, k_cmp: Array, config: Optional[Config] = None, lse_cmp: Optional[Array] = None,
           cu_seqlens: Optional[Offsets] = None, return_counts: bool = False, *,
           kv_len: int = 0) -> Union[Array, Tuple[Array, Array]]:
    """nsa_select: block_indices [B, T, H, n] int32, ascending, -1 padded (and block_counts
    [B, T, H] with return_counts). No gradient. kv_len: for a query chunk, the Tk tokens that
    k_cmp [B, Nc(Tk), H, DK] pools (the T queries are positions Tk - T .. Tk - 1); 0 = T."""
    return _core.select(_call_for(q), q, k_cmp, _core._as_config(config), lse_cmp, cu_seqlens, return_counts,
                        kv_len)


class AttentionResult:
    """What nsa.attention returns: .o, .lse (float32, [B, Tq, HQ]) and .backward(dout,
    dbias=False) -> AttentionGrads(dq, dk, dv, dsinks, dbias)."""

    def __init__(self, q, k, v, opts, o, lse):
        self._q, self._k, self._v, self._opts = q, k, v, opts
        self.o, self.lse = o, lse

    def backward(self, dout, dbias=False):
        """nsa_attention_bwd with the forward's inputs and options (the same dropout mask).
        dsinks comes back when sinks were given, dbias (float32, the bias's shape) when asked."""
        return _core.attention_backward(_call_for(self._q), self._q, self._k, self._v, self.o, self.lse, dout,
                                        self._opts, dbias)


def attention(q: Array, k: Array, v: Array, *, causal: bool = False, window: Tuple[int, int] = (-1, -1),
              scale: Optional[float] = None, softcap: float = 0.0, sinks: Optional[Array] = None,
              q_segment_ids: Optional[Array] = None, k_segment_ids: Optional[Array] = None, bias: Optional[Array] = None,
              mask: Optional[Array] = None, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
              cu_seqlens: Optional[Offsets] = None, cu_seqlens_q: Optional[Offsets] = None,
              cu_seqlens_k: Optional[Offsets] = None, out: Optional[Array] = None) -> AttentionResult:
    """nsa_attention, the library's flash-attention core (nsa.h section 5), on numpy arrays
    (CPU backend) or torch tensors (CPU or CUDA; with autograd when grad mode is on and q, k,
    v, sinks or bias requires a gradient: .o then carries grad_fn, and loss.backward() fills
    q.grad, k.grad, v.grad, sinks.grad, bias.grad; through the custom ops
    torch.ops.nsa.attention / attention_bwd, so torch.compile(fullgraph=True) traces it).
    q [B, Tq, HQ, DK], k [B, Tk, H, DK],
    v [B, Tk, H, DV], HQ % H == 0. causal (bottom-right aligned when Tq != Tk); window
    (left, right), -1 = unbounded; scale (None: 1/sqrt(DK)); softcap (0 = off) on the scaled
    score, bias [1 or B, 1 or HQ, Tq, Tk] added after it; sinks [HQ] float32 logits that join
    the softmax denominator; q/k_segment_ids [B, Tq] / [B, Tk] (attend within equal ids);
    mask [.., Tq, Tk] bool/uint8 (nonzero keeps); dropout_p with seed/offset (Philox, the
    backward regenerates the mask; advance offset by >= B * HQ between calls); cu_seqlens
    (int32, one packing) or cu_seqlens_q / cu_seqlens_k (separate packings, B == 1).
    Every option runs on CUDA too (f16 / bf16 tensors, f32 slowly; head dims up to 256). Returns an
    AttentionResult."""
    opts = dict(causal=causal, window=tuple(window), scale=scale, softcap=softcap, sinks=sinks, bias=bias, mask=mask,
                q_segment_ids=None if q_segment_ids is None else _as_int32(q_segment_ids),
                k_segment_ids=None if k_segment_ids is None else _as_int32(k_segment_ids),
                dropout_p=dropout_p, seed=seed, offset=offset, cu_seqlens=cu_seqlens, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k)
    if _is_torch(q) and _torch.attention_needs_grad(q, k, v, opts):
        if out is not None:
            raise TypeError("out= is for numpy arrays and torch calls without autograd")
        o, lse = _torch.attention(q, k, v, opts)
    else:
        o, lse = _core.attention(_call_for(q), q, k, v, opts, out=out)
    return AttentionResult(q, k, v, opts, o, lse)


# ---- attention with autograd -------------------------------------------------------------------


def native_sparse_attention(q: Array, k: Array, v: Array, g_cmp: Optional[Array], g_slc: Optional[Array],
                            g_swa: Optional[Array], config: Optional[Config] = None, k_cmp: Optional[Array] = None,
                            v_cmp: Optional[Array] = None, block_indices: Optional[Array] = None,
                            cu_seqlens: Optional[Offsets] = None, return_aux: bool = False, *,
                            block_counts: Optional[Array] = None, k_slc: Optional[Array] = None,
                            v_slc: Optional[Array] = None, k_swa: Optional[Array] = None, v_swa: Optional[Array] = None,
                            out: Optional[Array] = None) -> Union[Array, Tuple[Array, Aux]]:
    """NSA with the full configuration of the spec: o = g_cmp*o_cmp + g_slc*o_slc + g_swa*o_swa.

    q [B, T, HQ, DK]; k [B, T, H, DK]; v [B, T, H, DV]; g_* [B, T, HQ] or None (a missing
    gate turns its branch off; at least one is needed); config: nsa.Config (default: the
    paper's). k_cmp [B, Nc, H, DK], v_cmp [B, Nc, H, DV]: the caller's compression (a
    learnable phi), default mean pooling of k, v. block_indices [B, T, H, m] (+ block_counts
    [B, T, H]): the caller's selection instead of the computed top-n. cu_seqlens [N+1]
    (list, array or tensor, B == 1): packed variable-length sequences (k_cmp/v_cmp then
    packed too, rows from nsa.cmp_offsets). k_slc/v_slc, k_swa/v_swa: separate K/V of the
    selection / window branches. Returns o [B, T, HQ, DV] in q's dtype, and with
    return_aux=True also an Aux (selection, per-branch outputs and lse, detached).

    numpy arrays: the CPU backend, float32/float16 (bfloat16 via ml_dtypes); `out` may
    receive o (left untouched on any error). No gradients: nsa.forward(...).backward(dout).
    torch tensors: CPU or CUDA (the tensor's device, the current stream), through the custom
    op torch.ops.nsa.forward with autograd (gradients of q, k, v, gates, k_cmp/v_cmp,
    k_slc/v_slc, k_swa/v_swa), usable under torch.compile(fullgraph=True); under autocast
    every floating input is cast to the autocast dtype. Gates are cast to q's dtype. The
    forward keeps block_indices, the branch outputs (float32, for an exact fp32 backward on
    the CPU path) and the lse's for the backward.

    Errors: NsaError (.status = the C status, message = nsa_status_string)."""
    if _is_torch(q):
        if out is not None:
            raise TypeError("out= is for numpy arrays; torch calls return a new tensor")
        return _torch.native_sparse_attention(q, k, v, g_cmp, g_slc, g_swa, config, k_cmp, v_cmp, block_indices,
                                              block_counts, cu_seqlens, k_slc, v_slc, k_swa, v_swa, return_aux)
    res = forward(q, k, v, g_cmp, g_slc, g_swa, _core._as_config(config), k_cmp, v_cmp, block_indices, block_counts, cu_seqlens,
                  k_slc, v_slc, k_swa, v_swa, out=out)
    return (res.o, res.aux) if return_aux else res.o


def _numpy_fla_selection(q, k, config, counts, cu_seqlens):
    """numpy twin of _torch.fla_selection."""
    import dataclasses

    import numpy as np
    counts = np.asarray(counts).astype(np.int32)
    k_cmp = compress(k, config, cu_seqlens)
    forced = config.n_init + config.n_local
    values = sorted(set(int(c) for c in np.unique(np.maximum(counts, 0))))
    width = max([forced] + values)
    merged = np.full(counts.shape + (width,), -1, dtype=np.int32)
    for c in values:
        n = max(c, forced)
        idx = select(q, k_cmp, dataclasses.replace(config, slc_topk=n), cu_seqlens=cu_seqlens)
        pad = np.full(counts.shape + (width,), -1, dtype=np.int32)
        pad[..., :n] = idx
        merged = np.where((counts == c)[..., None], pad, merged)
    return merged, counts


def parallel_nsa(q: Array, k: Array, v: Array, g_cmp: Optional[Array] = None, g_slc: Optional[Array] = None,
                 g_swa: Optional[Array] = None, block_indices: Optional[Array] = None,
                 block_counts: Union[int, Array] = 16, block_size: int = 64, window_size: int = 0,
                 scale: Optional[float] = None, cu_seqlens: Union[None, Offsets, Tuple[Offsets, Offsets]] = None) -> Array:
    """Drop-in for fla.ops.nsa.parallel_nsa: the same arguments and meaning, NSA with
    l = d = l' = block_size (mean-pooled compression), n = block_counts, forced blocks
    0, cur-1, cur, and a sliding window of window_size.

    q [B, T, HQ, K]; k, v [B, T, H, K/V]; g_* [B, T, HQ]; block_indices [B, T, H, S];
    block_counts int or [B, T, H]; scale default K**-0.5; cu_seqlens [N+1] with B == 1.
    As in fla: g_cmp None skips the compressed branch; the selected branch is always on and
    g_slc None means a gate of 1; the window branch runs iff window_size > 0 (then g_swa is
    required) and g_swa is ignored otherwise; block_indices, when given, replace the
    computed selection; an int block_counts with block_indices given is not used (every
    entry is read); a tensor block_counts limits each row to its first block_counts entries.
    The window branch uses fla's scale for it, K**-0.5 (flash-attn's default), whatever
    `scale` is; compression and selection use `scale` (config.swa_scale carries the window's).

    Differences from fla: any GQA ratio (fla: HQ/H a power of 2 >= 16);
    an int block_counts is used as is (fla rounds it up to a power of 2 when it computes the
    selection); ties in the selection go to the lower block index (fla: unspecified); caller
    indices that repeat a block count it once (fla: once per occurrence); cu_seqlens must be
    one tensor or fla's (cu_q, cu_k) decoding tuple; with g_cmp
    and block_indices both None fla fails, nsa computes the selection anyway; float32 on CUDA
    runs on scalar kernels, exact but 300-450x slower than bf16 (fla's on Triton). With a tensor
    block_counts and no block_indices, row (b, t, h) attends to the top-c blocks, c its count
    (c < 3: the first c of the 3 forced ones, ascending); that path is eager only.

    Decoding, as fla: q shorter than k (queries are the last q.shape[1] positions of every
    sequence) or cu_seqlens=(cu_seqlens_q, cu_seqlens_k) (packed; each sequence's queries are
    its last tokens) run nsa_step against k, v as the cache (torch tensors; no gradient, and
    a tensor block_counts needs block_indices there). The dense form runs instead as a query
    chunk of the training path, with gradients, when autograd wants them (torch) or for numpy
    arrays, if the selection comes from block_indices or an int block_counts >= 3."""
    if block_counts is None:
        raise ValueError("block_counts must be provided for selection (an int or a [B, T, H] tensor)")
    if isinstance(cu_seqlens, tuple) or (cu_seqlens is None and q.shape[1] != k.shape[1]):
        if not _chunk_form(q, k, g_cmp, g_slc, g_swa, block_indices, block_counts, cu_seqlens):
            return _parallel_nsa_decode(q, k, v, g_cmp, g_slc, g_swa, block_indices, block_counts, block_size,
                                        window_size, scale, cu_seqlens)
    if window_size > 0 and g_swa is None:
        raise ValueError("window_size > 0 needs g_swa (the window branch's gate)")
    torch_path = _is_torch(q)
    counts_int = isinstance(block_counts, int) and not isinstance(block_counts, bool)
    forced = 3  # n_init + n_local of fla's rule: blocks 0, cur - 1, cur
    n = max(int(block_counts), forced) if counts_int else forced
    # a plain tuple (nsa_config's fields in order): nothing here builds objects inside a trace
    # fla's window branch is flash-attn at its default scale K**-0.5 whatever `scale` is
    config = (block_size, block_size, block_size, n, 1, 2, window_size if window_size > 0 else 1,
              0.0 if scale is None else float(scale), float(q.shape[-1]) ** -0.5)
    if g_slc is None:  # fla: o = o_slc when there is no selection gate
        g_slc = _full((q.shape[0], q.shape[1], q.shape[2]), 1, q.dtype, q, torch_path)
    counts = None
    if block_indices is None and (not counts_int or int(block_counts) < forced):
        cfg = Config(*config)
        if counts_int:
            block_counts = _full((q.shape[0], q.shape[1], k.shape[2]), int(block_counts), "int32", q, torch_path)
        if torch_path:
            block_indices, counts = _torch.fla_selection(q, k, cfg, block_counts, cu_seqlens)
        else:
            block_indices, counts = _numpy_fla_selection(q, k, cfg, block_counts, cu_seqlens)
    elif block_indices is not None and not counts_int:
        counts = block_counts
    return native_sparse_attention(q, k, v, g_cmp, g_slc, g_swa if window_size > 0 else None, config=config,
                                   block_indices=block_indices, cu_seqlens=cu_seqlens, block_counts=counts)


def _chunk_form(q, k, g_cmp, g_slc, g_swa, block_indices, block_counts, cu_seqlens):
    """Whether parallel_nsa's dense decoding form (q shorter than k) runs as a query chunk of the
    training path (spec 0.3) instead of an inference step: for numpy arrays, and for torch tensors
    when autograd wants a gradient (the step has none); the selection must come from an int
    block_counts >= 3 or from block_indices (the per-row counts' selection runs on whole
    sequences)."""
    if isinstance(cu_seqlens, tuple) or q.shape[1] > k.shape[1]:
        return False
    counts_int = isinstance(block_counts, int) and not isinstance(block_counts, bool)
    if block_indices is None and not (counts_int and int(block_counts) >= 3):
        return False
    if not _is_torch(q):
        return True
    torch = _torch.torch
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, g_cmp, g_slc, g_swa))


def _full(shape, value, dtype, like, torch_path):
    if torch_path:
        torch = _torch.torch
        return torch.full(shape, value, dtype=torch.int32 if dtype == "int32" else dtype, device=like.device)
    import numpy as np
    return np.full(shape, value, dtype=dtype)


def _parallel_nsa_decode(q, k, v, g_cmp, g_slc, g_swa, block_indices, block_counts, block_size, window_size, scale,
                         cu_seqlens):
    """parallel_nsa's decoding forms on nsa_step: k, v are the cache (contiguous for a dense
    batch; for packed sequences a paged view with one token per page, so nothing is copied),
    their mean-pooled compression the caller-kept compressed cache."""
    if not _is_torch(q):
        raise NotImplementedError("nsa.parallel_nsa: the decoding forms take torch tensors (numpy: nsa.step)")
    torch = _torch.torch
    if window_size > 0 and g_swa is None:
        raise ValueError("window_size > 0 needs g_swa (the window branch's gate)")
    counts_int = isinstance(block_counts, int) and not isinstance(block_counts, bool)
    if block_indices is None and not counts_int:
        raise NotImplementedError("nsa.parallel_nsa: decoding with a tensor block_counts needs block_indices")
    n = max(int(block_counts), 3) if counts_int else 3
    cfg = Config(block_size, block_size, block_size, n, 1, 2, window_size if window_size > 0 else 1,
                 0.0 if scale is None else float(scale), float(q.shape[-1]) ** -0.5)
    dev = q.device
    if g_slc is None:  # fla: o = o_slc when there is no selection gate
        g_slc = torch.ones(q.shape[:3], dtype=q.dtype, device=dev)
    g_swa = g_swa if window_size > 0 else None
    idx = None if block_indices is None else block_indices.to(torch.int32)
    cnt = None if block_indices is None or counts_int else block_counts.to(torch.int32)
    with torch.no_grad():
        if not isinstance(cu_seqlens, tuple):  # dense: queries are the last Tq of T tokens
            B, T = k.shape[0], k.shape[1]
            k_cmp, v_cmp = compress(k, cfg), compress(v, cfg)
            seqlens = torch.full((B,), T, dtype=torch.int32, device=dev)
            return step(q, (k, v), seqlens, cfg, cmp_cache=(k_cmp, v_cmp), cmp_by_caller=True, g_cmp=g_cmp, g_slc=g_slc,
                        g_swa=g_swa, block_indices=idx, block_counts=cnt)
        cu_q, cu_k = (list(int(x) for x in (c.tolist() if hasattr(c, "tolist") else c)) for c in cu_seqlens)
        if len(cu_q) != len(cu_k) or q.shape[0] != 1 or k.shape[0] != 1:
            raise ValueError("cu_seqlens=(cu_q, cu_k): one entry per sequence in both, and B == 1 (packed)")
        N = len(cu_k) - 1
        nq = [cu_q[b + 1] - cu_q[b] for b in range(N)]
        nk = [cu_k[b + 1] - cu_k[b] for b in range(N)]
        Tq, Lmax = max(nq + [1]), max(nk + [1])
        cmp0 = cmp_offsets(cfg, cu_k)
        ncmp = [cmp0[b + 1] - cmp0[b] for b in range(N)]
        Cmax = max(ncmp + [1])
        last = max(q.shape[1] - 1, 0)
        rows = torch.tensor([[min(cu_q[b] + min(i, max(nq[b] - 1, 0)), last) for i in range(Tq)] for b in range(N)],
                            dtype=torch.long, device=dev).reshape(N, Tq)
        if q.shape[1] == 0 or N == 0:
            return q.new_zeros((1, q.shape[1], q.shape[2], v.shape[-1]))

        def pad(x):  # packed [1, total_q, ...] -> [N, Tq, ...] (rows past a sequence repeat its last)
            return None if x is None else x[0][rows]
        table = torch.tensor([[cu_k[b] + min(r, max(nk[b] - 1, 0)) for r in range(Lmax)] for b in range(N)],
                             dtype=torch.int32, device=dev)
        ctable = torch.tensor([[cmp0[b] + min(c, max(ncmp[b] - 1, 0)) for c in range(Cmax)] for b in range(N)],
                              dtype=torch.int32, device=dev)
        cu_k_t = torch.tensor(cu_k, dtype=torch.int32)
        k_cmp, v_cmp = compress(k, cfg, cu_k_t), compress(v, cfg, cu_k_t)
        pages = (k[0].unsqueeze(1), v[0].unsqueeze(1), table)  # one token per page: the packed rows in place
        cpages = (k_cmp[0].unsqueeze(1), v_cmp[0].unsqueeze(1), ctable)
        o = step(pad(q), pages, torch.tensor(nk, dtype=torch.int32, device=dev), cfg,
                 q_lens=torch.tensor(nq, dtype=torch.int32, device=dev), cmp_cache=cpages, cmp_by_caller=True,
                 g_cmp=pad(g_cmp), g_slc=pad(g_slc), g_swa=pad(g_swa), block_indices=pad(idx), block_counts=pad(cnt))
        keep = torch.cat([torch.arange(nq[b], device=dev) + b * Tq for b in range(N)]) if N else rows.new_zeros(0)
        return o.reshape(N * Tq, *o.shape[2:])[keep].unsqueeze(0)



def flex_attention(query: Array, key: Array, value: Array, score_mod: Any = None, block_mask: Any = None,
                   scale: Optional[float] = None, enable_gqa: bool = False, return_lse: bool = False,
                   tensors: Optional[Dict[str, Array]] = None) -> Union[Array, Tuple[Array, Array]]:
    """FlexAttention's call on the library (nsa.flex.flex_attention: its docstring)."""
    from . import flex
    return flex.flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                               enable_gqa=enable_gqa, return_lse=return_lse, tensors=tensors)


def create_block_mask(mask_mod: Any, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int, device: Any = "cpu",
                      BLOCK_SIZE: Any = 128, tensors: Optional[Dict[str, Array]] = None) -> Any:
    """FlexAttention's create_block_mask (nsa.flex.create_block_mask: its docstring)."""
    from . import flex
    return flex.create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=BLOCK_SIZE, tensors=tensors)
