"""The C calls, written once for every array library.

A call object (_NumpyCall for numpy arrays on the CPU backend, _TorchCall in _torch.py for
torch tensors on the CPU or one CUDA device) turns arrays into nsa_tensor views, allocates
outputs and the workspace with the same library as the inputs, keeps every buffer alive
until the C call returns, and picks the nsa_context. The functions below fill the args
structs of nsa.h, ask for the workspace size, call, and raise NsaError on any status.
Nothing here records gradients: _torch.py wraps these in custom ops with autograd.
"""
import ctypes
import threading
from collections import namedtuple
from dataclasses import dataclass, fields

from . import _lib
from ._lib import library as _L

# ---- errors ---------------------------------------------------------------------------------


def status_string(status):
    """The C library's description of a status code."""
    return _L.nsa_status_string(int(status)).decode()


def status_name(status):
    """"BAD_DTYPE" for 5, and so on ("UNKNOWN" out of range)."""
    s = int(status)
    return _lib.STATUS_NAMES[s] if 0 <= s < len(_lib.STATUS_NAMES) else "UNKNOWN"


class NsaError(RuntimeError):
    """A C call returned a status other than success (or the binding found the same fault
    before calling). .status holds the nsa_status code, .name its enum name without the
    NSA_STATUS_ prefix, .op the call, .detail what is wrong: the library's
    nsa_last_error_detail() (the argument at fault, expected and given values) or the
    binding's own explanation. The message reads "nsa_<op>: <detail> (NSA_STATUS_<name>)",
    with the status string standing in for a missing detail."""

    def __init__(self, status, detail=None, op=None):
        self.status = int(status)
        self.name = status_name(self.status)
        self.op = op
        self.detail = detail
        msg = "%s (NSA_STATUS_%s)" % (detail or status_string(self.status), self.name)
        if op:
            msg = "nsa_%s: %s" % (op, msg)
        super().__init__(msg)


def _check(status, op):
    # ctypes calls run on this thread, so the per-thread detail read next is this call's own
    if status != _lib.STATUS_SUCCESS:
        raise NsaError(status, detail=_L.nsa_last_error_detail().decode(errors="replace") or None, op=op)


# ---- configuration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """nsa_config. Defaults are the paper's (l=32, d=16, l'=64, n=16, n_init=1, n_local=2,
    w=512); scale 0 or None means 1/sqrt(DK); swa_scale (the sliding-window branch's own
    scale) 0 or None means scale. Frozen, so it can be hashed and used as a constant under
    torch.compile."""

    cmp_len: int = 32
    cmp_stride: int = 16
    slc_block: int = 64
    slc_topk: int = 16
    n_init: int = 1
    n_local: int = 2
    window: int = 512
    scale: float = 0.0
    swa_scale: float = 0.0

    @classmethod
    def fla(cls, block_size=64, block_counts=16, window_size=0, scale=None):
        """fla's parallel_nsa configuration: l = d = l' = block_size, n = block_counts,
        forced blocks 0, cur-1 and cur (n_init=1, n_local=2), window w = window_size. fla's
        window branch is flash-attn at its default scale 1/sqrt(K) whatever `scale` is:
        parallel_nsa sets swa_scale to that (it knows K)."""
        return cls(cmp_len=block_size, cmp_stride=block_size, slc_block=block_size, slc_topk=block_counts,
                   n_init=1, n_local=2, window=window_size if window_size > 0 else 1,
                   scale=0.0 if scale is None else float(scale))

    def to_c(self):
        c = _CONFIG_C.get(self)
        if c is None:
            c = self._to_c()
            if len(_CONFIG_C) < 64:  # a model has a few configs; each call copies the struct
                _CONFIG_C[self] = c
        return c

    def _to_c(self):
        c = _lib.Config()
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("scale", "swa_scale"):
                setattr(c, f.name, 0.0 if v is None else float(v))
            else:
                setattr(c, f.name, int(v))
        return c

    def validate(self):
        """Raises NsaError naming the first invalid field (nsa_config_validate)."""
        c = self.to_c()
        _check(_L.nsa_config_validate(ctypes.byref(c)), "config_validate")
        return self

    def num_cmp_blocks(self, T):
        """Nc = floor((T - l) / d) + 1 for T >= l, else 0."""
        c = self.to_c()
        return int(_L.nsa_num_cmp_blocks(ctypes.byref(c), int(T)))

    def num_slc_blocks(self, T):
        """nb = ceil(T / l')."""
        c = self.to_c()
        return int(_L.nsa_num_slc_blocks(ctypes.byref(c), int(T)))


_CONFIG_C = {}  # Config -> its nsa_config (Config is frozen and hashable)


def _as_config(config):
    """nsa.Config from a Config, None (the paper's) or a tuple of nsa_config's fields in order."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, tuple):
        return Config(*config)
    raise TypeError("config must be nsa.Config, not %s" % type(config).__name__)


def config_tuple(config):
    """nsa_config's fields in order, as plain ints and a float."""
    if config is None:
        return DEFAULT_CONFIG
    if isinstance(config, tuple):
        return config
    if isinstance(config, Config):
        return (int(config.cmp_len), int(config.cmp_stride), int(config.slc_block), int(config.slc_topk),
                int(config.n_init), int(config.n_local), int(config.window), float(config.scale or 0.0),
                float(config.swa_scale or 0.0))
    raise TypeError("config must be nsa.Config, not %s" % type(config).__name__)


DEFAULT_CONFIG = (32, 16, 64, 16, 1, 2, 512, 0.0, 0.0)


# ---- variable length ------------------------------------------------------------------------


def cu_seqlens_list(cu_seqlens):
    """cu_seqlens (list, tuple, numpy array or torch tensor on any device) as a list of ints;
    the C library reads it from host memory."""
    if hasattr(cu_seqlens, "detach"):  # torch: a device tensor is copied to the host here
        cu_seqlens = cu_seqlens.detach().cpu()
    if hasattr(cu_seqlens, "tolist"):
        cu_seqlens = cu_seqlens.tolist()
    values = list(cu_seqlens)
    if not values or any(isinstance(x, (list, tuple)) for x in values):
        raise NsaError(_lib.STATUS_BAD_CU_SEQLENS, "cu_seqlens must be 1-D with num_seqs + 1 >= 1 entries")
    return [int(x) for x in values]


def _varlen(cu_seqlens, keep):
    vl = _lib.Varlen()
    if cu_seqlens is None:
        return vl
    values = cu_seqlens_list(cu_seqlens)
    if any(x < -2**31 or x >= 2**31 for x in values):
        raise NsaError(_lib.STATUS_BAD_CU_SEQLENS, "cu_seqlens entries must fit in int32")
    arr = (ctypes.c_int32 * len(values))(*values)
    keep.append(arr)
    vl.cu_seqlens = ctypes.cast(arr, ctypes.POINTER(ctypes.c_int32))
    vl.num_seqs = len(values) - 1
    return vl


def cmp_offsets(config, cu_seqlens):
    """Packed compressed-row offsets (nsa_cmp_offsets): list of num_seqs + 1 ints."""
    values = cu_seqlens_list(cu_seqlens)
    cfg = _as_config(config).to_c()
    arr = (ctypes.c_int32 * len(values))(*values)
    out = (ctypes.c_int64 * len(values))()
    _check(_L.nsa_cmp_offsets(ctypes.byref(cfg), arr, len(values) - 1, out), "cmp_offsets")
    return list(out)


def num_cmp_rows(config, T, cu_seqlens=None):
    """dim 1 of k_cmp: Nc(T), or the packed total under varlen."""
    if cu_seqlens is None:
        return _as_config(config).num_cmp_blocks(T)
    return cmp_offsets(config, cu_seqlens)[-1]


# ---- contexts ----------------------------------------------------------------------------------


class _Context:
    """Owns one nsa_context."""

    def __init__(self, backend, device=0, stream=None, num_threads=0):
        desc = _lib.ContextDesc(backend=backend, num_threads=num_threads, device=device, stream=stream)
        handle = ctypes.c_void_p()
        _check(_L.nsa_context_create(ctypes.byref(handle), ctypes.byref(desc)), "context_create")
        self.handle = handle
        self._destroy = _L.nsa_context_destroy

    def __del__(self):
        handle = getattr(self, "handle", None)
        if handle:
            self._destroy(handle)
            self.handle = None


_contexts = {}
_contexts_lock = threading.Lock()


def context(backend, device=0, stream=0):
    """The cached context for (backend, device, stream): one CPU context; one CUDA context
    per device and stream, so that concurrent streams never share one."""
    key = (backend, device, stream)
    ctx = _contexts.get(key)
    if ctx is None:
        with _contexts_lock:
            ctx = _contexts.get(key)
            if ctx is None:
                ctx = _Context(backend, device, stream or None)
                _contexts[key] = ctx
    return ctx.handle


_DTYPE_CODES = {"float32": _lib.DTYPE_F32, "float16": _lib.DTYPE_F16, "bfloat16": _lib.DTYPE_BF16,
                "int32": _lib.DTYPE_I32, "uint8": _lib.DTYPE_U8}


_DIMS = _lib.c_int64 * _lib.MAX_RANK


def _make_view(data, code, shape, strides, name):
    rank = len(shape)
    if not 1 <= rank <= _lib.MAX_RANK:
        raise NsaError(_lib.STATUS_BAD_RANK, "%s has rank %d (1 to 4 supported)" % (name, rank))
    if shape[-1] <= 1:  # a unit or empty last dim is read at offset 0 only
        strides = tuple(strides[:-1]) + (1,)
    # one constructor call: field by field this was most of a small call's Python time
    return _lib.Tensor(data, code, rank, _DIMS(*shape), _DIMS(*strides))


class Call:
    """One C call's buffers: every array handed to C is kept here until the call returns."""

    backend = _lib.BACKEND_CPU

    def __init__(self):
        self.keep = []

    def run(self, op, args):
        """nsa_<op>_workspace_size, the workspace, then nsa_<op>; NsaError on failure."""
        ctx = self.context()
        nbytes = ctypes.c_size_t(0)
        _check(getattr(_L, "nsa_%s_workspace_size" % op)(ctx, ctypes.byref(args), ctypes.byref(nbytes)), op)
        ws = self.workspace(nbytes.value)
        _check(getattr(_L, "nsa_" + op)(ctx, ctypes.byref(args), ws, nbytes.value), op)


class NumpyCall(Call):
    """numpy arrays on the CPU backend."""

    def __init__(self):
        super().__init__()
        import numpy
        self.np = numpy

    def view(self, a, name, output=False):
        np = self.np
        if not isinstance(a, np.ndarray):
            if output:
                raise TypeError("%s must be a numpy array" % name)
            a = np.asarray(a)
        if a.dtype == np.bool_ and not output:  # masks: one byte per element, nonzero = keep
            a = a.view(np.uint8)
        code = _DTYPE_CODES.get(a.dtype.name)
        if code is None:
            raise NsaError(_lib.STATUS_BAD_DTYPE, "%s has dtype %s (float32, float16, bfloat16 or int32 only)"
                           % (name, a.dtype.name))
        isz = a.itemsize
        if a.size == 0:  # no element to address: numpy reports zero strides, any valid ones do
            return self._empty_view(a, code, name)
        ok = all(s >= 0 and s % isz == 0 for s in a.strides) and a.ndim >= 1 and (
            a.shape[-1] <= 1 or a.strides[-1] == isz)
        if output and not a.flags.writeable:
            raise ValueError("%s is read-only" % name)
        if not ok:
            if output:
                raise NsaError(_lib.STATUS_BAD_STRIDE, "%s: an output needs non-negative element strides and a "
                               "unit last-dim stride" % name)
            a = np.ascontiguousarray(a)
        self.keep.append(a)
        return _make_view(a.ctypes.data, code, a.shape, [s // isz for s in a.strides], name)

    def _empty_view(self, a, code, name):
        """An empty array as a view: row-major element strides (an empty dim counted as 1)."""
        strides, step = [], 1
        for n in reversed(a.shape):
            strides.append(step)
            step *= max(int(n), 1)
        self.keep.append(a)
        return _make_view(a.ctypes.data, code, a.shape, list(reversed(strides)), name)

    def empty(self, shape, dtype):
        np = self.np
        if dtype == "f32":
            dtype = np.float32
        elif dtype == "i32":
            dtype = np.int32
        return np.empty(tuple(int(s) for s in shape), dtype=dtype)

    @staticmethod
    def dtype(a):
        return a.dtype

    def workspace(self, nbytes):
        if nbytes == 0:
            return None
        ws = self.np.empty(nbytes, dtype=self.np.uint8)
        self.keep.append(ws)
        return ws.ctypes.data

    def context(self):
        return context(_lib.BACKEND_CPU)


# ---- the operations -------------------------------------------------------------------------

FWD_INPUTS = ("q", "k", "v", "k_slc", "v_slc", "k_swa", "v_swa", "k_cmp", "v_cmp",
              "g_cmp", "g_slc", "g_swa", "block_indices", "block_counts")
BRANCHES = ("cmp", "slc", "swa")
SAVED = ("block_indices", "o_cmp", "o_slc", "o_swa", "lse_cmp", "lse_slc", "lse_swa")
GRADS = ("q", "k", "v", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_swa", "v_swa", "g_cmp", "g_slc", "g_swa")

Aux = namedtuple("Aux", SAVED)
Aux.__doc__ = """What the forward saved for the backward (None where a branch is off):
block_indices [B, T, H, n] int32 (the computed selection; None when the caller gave indices),
o_cmp/o_slc/o_swa [B, T, HQ, DV] per-branch outputs (float32 on the CPU backend, q's dtype on
CUDA), lse_* [B, T, HQ] float32."""
Grads = namedtuple("Grads", GRADS)
Grads.__doc__ = "Gradients of the forward's inputs (None for inputs that were not given)."


def _dims(a, name, rank):
    shape = tuple(a.shape)
    if len(shape) != rank:
        raise NsaError(_lib.STATUS_BAD_RANK, "%s must have rank %d, got shape %s" % (name, rank, shape))
    return shape


def _fill_forward(call, a, tensors, saved, config, cu_seqlens):
    for name in FWD_INPUTS:
        if tensors.get(name) is not None:
            setattr(a, name, call.view(tensors[name], name))
    for name in SAVED:
        if saved.get(name) is not None:
            setattr(a.saved, name, call.view(saved[name], "saved." + name, output=True))
    a.varlen = _varlen(cu_seqlens, call.keep)
    a.config = config.to_c()


def forward(call, tensors, config, cu_seqlens=None, out=None):
    """nsa_forward. tensors: FWD_INPUTS name -> array or None. Returns (o, saved dict).
    The saved branch outputs are float32 on the CPU backend (any float dtype is allowed;
    float32 keeps the CPU backward exact to fp32) and q's dtype on the CUDA backend, whose
    kernels round them there anyway: half the memory and traffic of float32 (the gate reads
    all three, the backward again; 64k paper config: 6.4 GB of writes instead of 3.2)."""
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    B, T, HQ, _ = _dims(q, "q", 4)
    H = _dims(k, "k", 4)[2]
    DV = _dims(v, "v", 4)[3]
    saved = {}
    o_dt = call.dtype(q) if getattr(call, "backend", None) == _lib.BACKEND_CUDA else "f32"
    if tensors.get("g_slc") is not None and tensors.get("block_indices") is None:
        saved["block_indices"] = call.empty((B, T, H, max(config.slc_topk, 0)), "i32")
    for br in BRANCHES:
        if tensors.get("g_" + br) is not None:
            saved["o_" + br] = call.empty((B, T, HQ, DV), o_dt)
            saved["lse_" + br] = call.empty((B, T, HQ), "f32")
    o = out if out is not None else call.empty((B, T, HQ, DV), call.dtype(q))
    a = _lib.ForwardArgs()
    _fill_forward(call, a, tensors, saved, config, cu_seqlens)
    a.o = call.view(o, "out", output=True)
    call.run("forward", a)
    return o, saved


def backward(call, tensors, saved, config, cu_seqlens, dout):
    """nsa_backward: the forward's tensors and saved dict, and dout. Returns a dict GRADS
    name -> gradient (absent inputs absent)."""
    a = _lib.BackwardArgs()
    _fill_forward(call, a.fwd, tensors, saved, config, cu_seqlens)
    a.dout = call.view(dout, "dout")
    grads = {}
    for name in GRADS:
        x = tensors.get(name)
        if x is None:
            continue
        grads[name] = call.empty(x.shape, call.dtype(x))
        setattr(a, "d" + name, call.view(grads[name], "d" + name, output=True))
    call.run("backward", a)
    return grads


def compress(call, x, config, cu_seqlens=None):
    """nsa_compress: mean over overlapping blocks, x [B, T, H, D] -> [B, Nc, H, D]."""
    B, T, H, D = _dims(x, "x", 4)
    rows = num_cmp_rows(config, T, cu_seqlens)
    x_cmp = call.empty((B, rows, H, D), call.dtype(x))
    a = _lib.CompressArgs()
    a.x = call.view(x, "x")
    a.x_cmp = call.view(x_cmp, "x_cmp", output=True)
    a.varlen = _varlen(cu_seqlens, call.keep)
    a.config = config.to_c()
    call.run("compress", a)
    return x_cmp


def select(call, q, k_cmp, config, lse_cmp=None, cu_seqlens=None, counts=False, kv_len=0):
    """nsa_select: block_indices [B, T, H, n] int32 (ascending, -1 padded), and with
    counts=True also block_counts [B, T, H]. kv_len: Tk of a query chunk (0: q's T)."""
    B, T, HQ, _ = _dims(q, "q", 4)
    H = _dims(k_cmp, "k_cmp", 4)[2]
    idx = call.empty((B, T, H, max(config.slc_topk, 0)), "i32")
    cnt = call.empty((B, T, H), "i32") if counts else None
    a = _lib.SelectArgs()
    a.q = call.view(q, "q")
    a.k_cmp = call.view(k_cmp, "k_cmp")
    if lse_cmp is not None:
        a.lse_cmp = call.view(lse_cmp, "lse_cmp")
    a.block_indices = call.view(idx, "block_indices", output=True)
    if cnt is not None:
        a.block_counts = call.view(cnt, "block_counts", output=True)
    a.varlen = _varlen(cu_seqlens, call.keep)
    a.config = config.to_c()
    a.kv_len = int(kv_len)
    call.run("select", a)
    return (idx, cnt) if counts else idx


# ---- the flash-attention core (nsa.h section 5) ----------------------------------------------

ATTN_TENSORS = ("sinks", "q_segment_ids", "k_segment_ids", "bias", "mask")
AttentionGrads = namedtuple("AttentionGrads", ("dq", "dk", "dv", "dsinks", "dbias"))
AttentionGrads.__doc__ = "nsa.attention's gradients (dsinks / dbias None unless sinks / dbias were asked for)."


def _varlen_qk(cu_q, cu_k, keep):
    vl = _lib.VarlenQK()
    if cu_q is None and cu_k is None:
        return vl
    if cu_q is None or cu_k is None:
        raise NsaError(_lib.STATUS_BAD_CU_SEQLENS, "cu_seqlens_q and cu_seqlens_k go together")
    lq, lk = cu_seqlens_list(cu_q), cu_seqlens_list(cu_k)
    if len(lq) != len(lk):
        raise NsaError(_lib.STATUS_BAD_CU_SEQLENS, "cu_seqlens_q and cu_seqlens_k differ in length")
    aq, ak = (ctypes.c_int64 * len(lq))(*lq), (ctypes.c_int64 * len(lk))(*lk)
    keep.extend((aq, ak))
    vl.cu_seqlens_q = ctypes.cast(aq, ctypes.POINTER(ctypes.c_int64))
    vl.cu_seqlens_k = ctypes.cast(ak, ctypes.POINTER(ctypes.c_int64))
    vl.num_seqs = len(lq) - 1
    return vl


def _fill_attention(call, a, q, k, v, o, lse, opts, forward):
    """Fills nsa_attention_args: q, k, v, o, lse views (o and lse are the forward's outputs,
    the backward's inputs) and the options dict (see nsa.attention)."""
    a.q, a.k, a.v = call.view(q, "q"), call.view(k, "k"), call.view(v, "v")
    a.o = call.view(o, "o", output=forward)
    a.lse = call.view(lse, "lse", output=forward)
    a.varlen = _varlen(opts.get("cu_seqlens"), call.keep)
    a.varlen_qk = _varlen_qk(opts.get("cu_seqlens_q"), opts.get("cu_seqlens_k"), call.keep)
    a.scale = float(opts.get("scale") or 0.0)
    a.causal = 1 if opts.get("causal") else 0
    wl, wr = opts.get("window", (-1, -1))
    a.window_left, a.window_right = int(wl), int(wr)
    a.softcap = float(opts.get("softcap") or 0.0)
    for name in ATTN_TENSORS:
        x = opts.get(name)
        if x is not None:
            setattr(a, name, call.view(x, name))
    a.dropout_p = float(opts.get("dropout_p") or 0.0)
    a.dropout_seed = int(opts.get("seed") or 0)
    a.dropout_offset = int(opts.get("offset") or 0)


def attention(call, q, k, v, opts, out=None):
    """nsa_attention: (o [B, Tq, HQ, DV] in q's dtype, lse [B, Tq, HQ] float32)."""
    B, Tq, HQ, _ = _dims(q, "q", 4)
    DV = _dims(v, "v", 4)[3]
    o = out if out is not None else call.empty((B, Tq, HQ, DV), call.dtype(q))
    lse = call.empty((B, Tq, HQ), "f32")
    a = _lib.AttentionArgs()
    _fill_attention(call, a, q, k, v, o, lse, opts, forward=True)
    call.run("attention", a)
    return o, lse


def attention_backward(call, q, k, v, o, lse, dout, opts, dbias=False):
    """nsa_attention_bwd: AttentionGrads (dq, dk, dv like q, k, v; dsinks [HQ] float32 when
    sinks are given; dbias float32 shaped like bias when dbias=True)."""
    a = _lib.AttentionBwdArgs()
    _fill_attention(call, a.fwd, q, k, v, o, lse, opts, forward=False)
    a.dout = call.view(dout, "dout")
    dq, dk, dv = (call.empty(x.shape, call.dtype(x)) for x in (q, k, v))
    a.dq, a.dk, a.dv = call.view(dq, "dq", output=True), call.view(dk, "dk", output=True), call.view(dv, "dv", output=True)
    ds = db = None
    if opts.get("sinks") is not None:
        ds = call.empty(opts["sinks"].shape, "f32")
        a.dsinks = call.view(ds, "dsinks", output=True)
    if dbias:
        if opts.get("bias") is None:
            raise ValueError("dbias=True needs a bias")
        db = call.empty(opts["bias"].shape, "f32")
        a.dbias = call.view(db, "dbias", output=True)
    call.run("attention_bwd", a)
    return AttentionGrads(dq, dk, dv, ds, db)


def _cache(call, a, cache, name, out):
    """(k, v) or (k, v, block_table) into an nsa_kv_cache."""
    if cache is None:
        return
    if not isinstance(cache, (tuple, list)) or len(cache) not in (2, 3):
        raise TypeError("%s must be (k, v) or (k, v, block_table)" % name)
    a.k = call.view(cache[0], name + ".k", output=out)
    a.v = call.view(cache[1], name + ".v", output=out)
    if len(cache) == 3 and cache[2] is not None:
        a.block_table = call.view(cache[2], name + ".block_table")


def _step_common(call, a, q, cache, seqlens, q_lens, k_new, v_new):
    """The fields nsa_step and nsa_attention_step share: q, lengths, the new tokens, the cache."""
    a.q = call.view(q, "q")
    a.seqlens = call.view(seqlens, "seqlens")
    if q_lens is not None:
        a.q_lens = call.view(q_lens, "q_lens")
    if k_new is not None:
        a.k_new = call.view(k_new, "k_new")
    if v_new is not None:
        a.v_new = call.view(v_new, "v_new")
    _cache(call, a.cache, cache, "cache", k_new is not None)


def step(call, q, cache, seqlens, config, q_lens=None, k_new=None, v_new=None, cmp_cache=None, cmp_by_caller=False,
         gates=(None, None, None), block_indices=None, block_counts=None, want_selected=False, want_errors=False):
    """nsa_step (spec 12): q [B, Tq, HQ, DK] against the caches (appended to when k_new / v_new
    are given, compressed rows pooled unless cmp_by_caller). Returns (o, selected, errors):
    o [B, Tq, HQ, DV] (rows past q_lens[b] are 0), the selection made [B, Tq, H, n] (-1 past
    q_lens[b]) and the per-sequence error codes [B] when asked, else None."""
    B, Tq, HQ, _ = _dims(q, "q", 4)
    H = _dims(cache[0], "cache.k", 4)[2]
    DV = _dims(cache[1], "cache.v", 4)[3]
    a = _lib.StepArgs()
    _step_common(call, a, q, cache, seqlens, q_lens, k_new, v_new)
    _cache(call, a.cmp_cache, cmp_cache, "cmp_cache", not cmp_by_caller)
    a.cmp_by_caller = 1 if cmp_by_caller else 0
    for name, g in zip(("g_cmp", "g_slc", "g_swa"), gates):
        if g is not None:
            setattr(a, name, call.view(g, name))
    if block_indices is not None:
        a.block_indices = call.view(block_indices, "block_indices")
    if block_counts is not None:
        a.block_counts = call.view(block_counts, "block_counts")
    o = call.empty((B, Tq, HQ, DV), call.dtype(q))  # every row written: rows without a query get zeros
    a.o = call.view(o, "o", output=True)
    selected = errors = None
    if want_selected and gates[1] is not None and block_indices is None:
        selected = call.empty((B, Tq, H, max(config.slc_topk, 0)), "i32")
        a.selected = call.view(selected, "selected", output=True)
    if want_errors:
        errors = call.empty((B,), "i32")
        a.errors = call.view(errors, "errors", output=True)
    a.config = config.to_c()
    call.run("step", a)
    return o, selected, errors


def attention_step(call, q, cache, seqlens, q_lens=None, k_new=None, v_new=None, scale=0.0, causal=True, window=(-1, -1),
                   softcap=0.0, sinks=None, want_lse=False, want_errors=False):
    """nsa_attention_step (spec 12.1): dense attention of q [B, Tq, HQ, DK] against the token
    cache (appended to when k_new / v_new are given). Returns (o, lse, errors): o [B, Tq, HQ, DV]
    (rows past q_lens[b] are 0), lse [B, Tq, HQ] float32 (-inf there) and the per-sequence error codes [B]
    when asked, else None."""
    B, Tq, HQ, _ = _dims(q, "q", 4)
    DV = _dims(cache[1], "cache.v", 4)[3]
    a = _lib.AttentionStepArgs()
    _step_common(call, a, q, cache, seqlens, q_lens, k_new, v_new)
    if sinks is not None:
        a.sinks = call.view(sinks, "sinks")
    a.scale = float(scale or 0.0)
    a.causal = 1 if causal else 0
    a.window_left, a.window_right = (int(window[0]), int(window[1]))
    a.softcap = float(softcap or 0.0)
    o = call.empty((B, Tq, HQ, DV), call.dtype(q))  # every row written: rows without a query get zeros
    a.o = call.view(o, "o", output=True)
    lse = errors = None
    if want_lse:
        lse = call.empty((B, Tq, HQ), "f32")
        a.lse = call.view(lse, "lse", output=True)
    if want_errors:
        errors = call.empty((B,), "i32")
        a.errors = call.view(errors, "errors", output=True)
    call.run("attention_step", a)
    return o, lse, errors
