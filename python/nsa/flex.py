"""Block-sparse attention with FlexAttention's BlockMask and mods (spec 13, 14), with
FlexAttention's names and [B, H, T, D] layout:

    def doc_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])
    def alibi(score, b, h, q_idx, kv_idx):
        return score - slope[h] * torch.abs(q_idx - kv_idx)
    bm = nsa.create_block_mask(doc_causal, B, None, T, T)
    o = nsa.flex_attention(q, k, v, score_mod=alibi, block_mask=bm)

A mod is a Python callable, traced once into the expression language of spec 13 (operators,
comparisons, `&`, `|`, `~`, `torch.where`, the math functions, reads of the tensors it names
as globals or closure variables: numpy arrays or torch tensors), or the expression as a string
with its tensors given as `tensors={"doc": doc}`. Anything a trace cannot express (an `if` on a
value, Python's `min` / `max` / `and` / `or` on traced values, another function) raises
TypeError naming the operation. numpy arrays run on the CPU backend; torch tensors run where
they live (CPU or CUDA) with autograd for q, k, v and the float tensors a score_mod reads.
"""
from __future__ import annotations

import ctypes
import math
import types
from typing import Any, Callable, Dict, Optional, Tuple, Union

from . import _core, _lib
from ._lib import library as _L

Array = Any
ModLike = Union[None, str, Callable]


# ---- tracing a callable into an expression ------------------------------------------------------

class _Sym:
    """A traced value: the expression text that computes it."""

    __slots__ = ("text",)

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return self.text

    def __bool__(self):
        raise TypeError("nsa: a traced mod cannot branch on a value (if, and, or, not, Python's min / max): "
                        "use torch.where, &, |, ~, torch.minimum / torch.maximum")

    def __index__(self):
        raise TypeError("nsa: a traced value cannot index a Python list or an untraced tensor: read the tensor as a "
                        "global or closure variable of the mod (it is captured by name)")

    __hash__ = None  # (== builds an expression)

    def _bin(self, op, other, flip=False):
        a, b = (_text(other), self.text) if flip else (self.text, _text(other))
        return _Sym("(%s %s %s)" % (a, op, b))

    def __add__(self, o): return self._bin("+", o)
    def __radd__(self, o): return self._bin("+", o, True)
    def __sub__(self, o): return self._bin("-", o)
    def __rsub__(self, o): return self._bin("-", o, True)
    def __mul__(self, o): return self._bin("*", o)
    def __rmul__(self, o): return self._bin("*", o, True)
    def __truediv__(self, o): return self._bin("/", o)
    def __rtruediv__(self, o): return self._bin("/", o, True)
    def __floordiv__(self, o): return self._bin("//", o)
    def __rfloordiv__(self, o): return self._bin("//", o, True)
    def __mod__(self, o): return self._bin("%", o)
    def __rmod__(self, o): return self._bin("%", o, True)
    def __and__(self, o): return self._bin("&", o)
    def __rand__(self, o): return self._bin("&", o, True)
    def __or__(self, o): return self._bin("|", o)
    def __ror__(self, o): return self._bin("|", o, True)
    def __xor__(self, o): return self._bin("^", o)
    def __rxor__(self, o): return self._bin("^", o, True)
    def __lt__(self, o): return self._bin("<", o)
    def __le__(self, o): return self._bin("<=", o)
    def __gt__(self, o): return self._bin(">", o)
    def __ge__(self, o): return self._bin(">=", o)
    def __eq__(self, o): return self._bin("==", o)  # type: ignore[override]
    def __ne__(self, o): return self._bin("!=", o)  # type: ignore[override]
    def __neg__(self): return _Sym("(-%s)" % self.text)
    def __pos__(self): return self
    def __invert__(self): return _Sym("(~%s)" % self.text)
    def __abs__(self): return _Sym("abs(%s)" % self.text)

    def __pow__(self, o):
        raise TypeError("nsa: '**' is not in the mod language (write x * x, or sqrt / exp / log)")

    # tensor-method spellings
    def exp(self): return _Sym("exp(%s)" % self.text)
    def log(self): return _Sym("log(%s)" % self.text)
    def tanh(self): return _Sym("tanh(%s)" % self.text)
    def sigmoid(self): return _Sym("sigmoid(%s)" % self.text)
    def sqrt(self): return _Sym("sqrt(%s)" % self.text)
    def abs(self): return _Sym("abs(%s)" % self.text)
    def floor(self): return _Sym("floor(%s)" % self.text)

    def clamp(self, min=None, max=None):  # noqa: A002  (torch's names)
        x = self
        if min is not None:
            x = _Sym("max(%s, %s)" % (x.text, _text(min)))
        if max is not None:
            x = _Sym("min(%s, %s)" % (x.text, _text(max)))
        return x

    def __getattr__(self, name):
        raise TypeError("nsa: '.%s' on a traced value is not in the mod language" % name)


def _text(x):
    if isinstance(x, _Sym):
        return x.text
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x) if x >= 0 else "(%d)" % x
    if isinstance(x, float):
        if math.isinf(x):
            return "(-exp(1000.0))" if x < 0 else "exp(1000.0)"
        return repr(x) if x >= 0 else "(%r)" % x
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:  # a 0-d array or tensor: its value
        return _text(x.item())
    raise TypeError("nsa: a %s is not in the mod language (numbers, traced values and captured tensors only)"
                    % type(x).__name__)


class _TensorProxy:
    """A captured tensor while tracing: indexing reads it by name."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        return _Sym("%s[%s]" % (self.name, ", ".join(_text(i) for i in idx)))

    def __getattr__(self, name):
        raise TypeError("nsa: '%s.%s' is not in the mod language (index the tensor: %s[...])" % (self.name, name, self.name))


def _fn(name, arity, lang):
    """torch.<name> / math.<name> while tracing: the language's function `lang`."""
    def f(*args, **kw):
        if kw or len(args) != arity:
            raise TypeError("nsa: %s takes %d positional argument%s in a mod" % (name, arity, "s" if arity > 1 else ""))
        return _Sym("%s(%s)" % (lang, ", ".join(_text(a) for a in args)))
    return f


class _Shim:
    """torch / math while tracing: the functions the mod language has, an error for the rest."""

    def __init__(self, module, funcs):
        self._module, self._funcs = module, funcs

    def __getattr__(self, name):
        if name in self._funcs:
            return self._funcs[name]
        if name in ("int32", "int64", "float32", "float16", "bfloat16", "bool", "inf", "pi", "e"):
            return getattr(self._real, name) if hasattr(self, "_real") else getattr(math, name)
        raise TypeError("nsa: %s.%s is not in the mod language (where, exp, log, tanh, sigmoid, sqrt, abs, floor, "
                        "minimum, maximum, clamp)" % (self._module, name))


_TORCH_FUNCS = {"where": (3, "where"), "exp": (1, "exp"), "log": (1, "log"), "tanh": (1, "tanh"), "sigmoid": (1, "sigmoid"),
                "sqrt": (1, "sqrt"), "abs": (1, "abs"), "floor": (1, "floor"), "minimum": (2, "min"), "maximum": (2, "max")}
_MATH_FUNCS = {"exp": (1, "exp"), "log": (1, "log"), "tanh": (1, "tanh"), "sqrt": (1, "sqrt"), "floor": (1, "floor"),
               "fabs": (1, "abs")}


def _torch_shim(real):
    funcs = {n: _fn("torch." + n, a, lang) for n, (a, lang) in _TORCH_FUNCS.items()}
    funcs["clamp"] = lambda x, min=None, max=None: (x if isinstance(x, _Sym) else _Sym(_text(x))).clamp(min, max)
    s = _Shim("torch", funcs)
    s._real = real
    return s


def _math_shim():
    return _Shim("math", {n: _fn("math." + n, a, lang) for n, (a, lang) in _MATH_FUNCS.items()})


_RESERVED = {"b", "h", "q_idx", "kv_idx", "score", "true", "false", "True", "False", "where", "min", "max", "abs", "exp",
             "log", "tanh", "sigmoid", "sqrt", "floor"}


def _is_tensor(x):
    mod = type(x).__module__
    return (mod.startswith("numpy") and type(x).__name__ == "ndarray") or (
        mod.startswith("torch") and type(x).__name__ in ("Tensor", "Parameter"))


def trace(fn: ModLike, kind: str) -> Tuple[Optional[str], Dict[str, Array]]:
    """(expression text, {name: tensor}) of a mod: a string passes through; a callable is
    called once with traced arguments, its global and closure tensors read by name."""
    if fn is None or isinstance(fn, str):
        return fn, {}
    if not callable(fn) or not hasattr(fn, "__code__"):
        raise TypeError("nsa: a %s must be a Python function or an expression string, not %s" % (kind, type(fn).__name__))
    code = fn.__code__
    tensors: Dict[str, Array] = {}

    def proxy(name, value):
        if _is_tensor(value):
            if name in _RESERVED or not name.isidentifier():
                raise TypeError("nsa: the captured tensor '%s' needs another name (a variable or function of the mod "
                                "language)" % name)
            tensors[name] = value
            return _TensorProxy(name)
        if isinstance(value, types.ModuleType) and value.__name__ == "torch":
            return _torch_shim(value)
        if isinstance(value, types.ModuleType) and value.__name__ == "math":
            return _math_shim()
        return value

    glb = dict(fn.__globals__)
    for name in code.co_names:
        if name in glb:
            glb[name] = proxy(name, glb[name])
    closure = None
    if fn.__closure__:
        closure = tuple(types.CellType(proxy(n, c.cell_contents)) for n, c in zip(code.co_freevars, fn.__closure__))
    traced = types.FunctionType(code, glb, fn.__name__, fn.__defaults__, closure)
    names = ("b", "h", "q_idx", "kv_idx") if kind == "mask_mod" else ("score", "b", "h", "q_idx", "kv_idx")
    out = traced(*[_Sym(n) for n in names])
    return _text(out), tensors


# ---- mods in the library --------------------------------------------------------------------------

class Mod:
    """A compiled mod (nsa_mod): the expression, the tensors it reads (kept alive, converted
    where the library reads another dtype: int64 -> int32, bool -> uint8, float64 -> float32)."""

    def __init__(self, fn: ModLike, kind: str, tensors: Optional[Dict[str, Array]] = None):
        self.kind = kind
        text, found = trace(fn, kind)
        self.text = text
        self.tensors = dict(found)
        self.tensors.update(tensors or {})
        self._ptr = ctypes.c_void_p()
        self.names = list(self.tensors)
        self._arrays = [self._readable(self.tensors[n], n) for n in self.names]
        cs = (_lib.ModTensor * max(len(self.names), 1))()
        call = _core.NumpyCall() if not self._arrays or not _is_torch_tensor(self._arrays[0]) else _torch_call(self._arrays[0])
        self._call = call
        for i, (n, a) in enumerate(zip(self.names, self._arrays)):
            cs[i].name = n.encode()
            cs[i].tensor = call.view(a, "%s tensor '%s'" % (kind, n))
        st = _L.nsa_mod_create(ctypes.byref(self._ptr), 0 if kind == "mask_mod" else 1, text.encode(), cs, len(self.names))
        _core._check(st, "mod_create")
        # plain attributes for torch.compile's tracing (no ctypes there): the handle, the float tensors
        self.handle = int(self._ptr.value)
        self.float_idx = [i for i, a in enumerate(self._arrays) if "float" in str(getattr(a, "dtype", ""))]
        self.float_list = [self.tensors[self.names[i]] for i in self.float_idx]
        _LIVE[self.handle] = self

    @staticmethod
    def _readable(a, name):
        if _is_torch_tensor(a):
            import torch
            a = a.detach()
            conv = {torch.int64: torch.int32, torch.int16: torch.int32, torch.int8: torch.int32, torch.bool: torch.uint8,
                    torch.float64: torch.float32}
            return a.to(conv[a.dtype]) if a.dtype in conv else a
        import numpy as np
        a = np.asarray(a)
        conv = {"int64": np.int32, "int16": np.int32, "int8": np.int32, "bool": np.uint8, "float64": np.float32}
        return a.astype(conv[a.dtype.name]) if a.dtype.name in conv else a

    @property
    def ptr(self):
        return self._ptr.value

    def float_tensors(self):
        """(index, name, original tensor) of the float tensors (their gradients can be asked for)."""
        return [(i, n, self.tensors[n]) for i, n in enumerate(self.names)
                if "float" in str(getattr(self._arrays[i], "dtype", ""))]

    def __del__(self):
        if getattr(self, "_ptr", None) is not None and self._ptr.value:
            _L.nsa_mod_destroy(self._ptr)
            self._ptr = ctypes.c_void_p()

    def __repr__(self):
        return "nsa.flex.Mod(%s: %s; tensors %s)" % (self.kind, self.text, ", ".join(self.names) or "none")


# handle -> Mod, while the Mod lives: the torch custom ops carry a mod as its handle (an int)
import weakref  # noqa: E402
_LIVE: "weakref.WeakValueDictionary[int, Mod]" = weakref.WeakValueDictionary()


def _mod_of(handle):
    if not handle:
        return None
    m = _LIVE.get(handle)
    if m is None:
        raise RuntimeError("nsa: a mod used by a compiled flex_attention call was freed (keep the Mod or BlockMask alive)")
    return m


def _is_torch_tensor(x):
    return type(x).__module__.startswith("torch")


def _torch_call(t):
    from . import _torch
    return _torch.TorchCall(t.device)


# ---- block masks ----------------------------------------------------------------------------------

class BlockMask:
    """FlexAttention's BlockMask: kv_num_blocks [Bm, Hm, NQB] and kv_indices [Bm, Hm, NQB, NKB]
    (partial blocks: the mask_mod applies), full_kv_num_blocks / full_kv_indices (every pair
    visible), BLOCK_SIZE (q_block, kv_block) and the mask_mod (a Mod)."""

    def __init__(self, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None, BLOCK_SIZE=(128, 128),
                 mask_mod: ModLike = None, seq_lengths=None, tensors=None):
        self.kv_num_blocks, self.kv_indices = kv_num_blocks, kv_indices
        self.full_kv_num_blocks, self.full_kv_indices = full_kv_num_blocks, full_kv_indices
        self.BLOCK_SIZE = tuple(BLOCK_SIZE) if isinstance(BLOCK_SIZE, (tuple, list)) else (BLOCK_SIZE, BLOCK_SIZE)
        self.mask_mod = mask_mod if isinstance(mask_mod, Mod) or mask_mod is None else Mod(mask_mod, "mask_mod", tensors)
        self.seq_lengths = seq_lengths

    def __repr__(self):
        return "nsa.BlockMask(shape %s, BLOCK_SIZE %s, mask_mod %s)" % (
            tuple(self.kv_indices.shape), self.BLOCK_SIZE, self.mask_mod.text if self.mask_mod else None)


def create_block_mask(mask_mod: ModLike, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                      device: Any = "cpu", BLOCK_SIZE: Union[int, Tuple[int, int]] = 128,
                      tensors: Optional[Dict[str, Array]] = None) -> BlockMask:
    """FlexAttention's create_block_mask: the mask_mod evaluated on every pair (nsa_create_block_mask,
    on the host, reading host copies of tensors that live on a GPU); B or H None: broadcast over it. device "cpu" gives numpy arrays when torch is
    absent, else torch tensors on `device`."""
    import numpy as np
    mod = mask_mod if isinstance(mask_mod, Mod) else (Mod(mask_mod, "mask_mod", tensors) if mask_mod is not None else None)
    qb, kb = BLOCK_SIZE if isinstance(BLOCK_SIZE, (tuple, list)) else (BLOCK_SIZE, BLOCK_SIZE)
    Bm, Hm = B or 1, H or 1
    nqb, nkb = -(-Q_LEN // qb), -(-KV_LEN // kb)
    arrs = [np.zeros((Bm, Hm, nqb), np.int32), np.zeros((Bm, Hm, nqb, nkb), np.int32),
            np.zeros((Bm, Hm, nqb), np.int32), np.zeros((Bm, Hm, nqb, nkb), np.int32)]
    host_mod = mod
    if mod is not None and any(_is_torch_tensor(t) and t.device.type != "cpu" for t in mod.tensors.values()):
        # the mask is evaluated on the host: a twin of the mod reading host copies of its tensors
        # (the BlockMask keeps the original, whose tensors the GPU call reads)
        # (host copies of the tensors the GPU call reads: the mod's converted ones)
        host_mod = Mod(mod.text, "mask_mod", {n: (a.cpu() if _is_torch_tensor(a) else a) for n, a in zip(mod.names, mod._arrays)})
    m = _lib.BlockMask()
    m.q_block, m.kv_block = qb, kb
    call = _core.NumpyCall()
    m.kv_num_blocks, m.kv_indices = call.view(arrs[0], "kv_num_blocks", True), call.view(arrs[1], "kv_indices", True)
    m.full_kv_num_blocks = call.view(arrs[2], "full_kv_num_blocks", True)
    m.full_kv_indices = call.view(arrs[3], "full_kv_indices", True)
    _core._check(_L.nsa_create_block_mask(host_mod.ptr if host_mod else None, Q_LEN, KV_LEN, ctypes.byref(m)), "create_block_mask")
    if _wants_torch(device):
        import torch
        arrs = [torch.from_numpy(a).to(device) for a in arrs]
        _note_made(arrs, mod, host_mod, (qb, kb), Q_LEN, KV_LEN)
    return BlockMask(arrs[0], arrs[1], arrs[2], arrs[3], (qb, kb), mod, (Q_LEN, KV_LEN))


def _note_made(arrs, mod, host_mod, block, Q_LEN, KV_LEN):
    """Notes on the counts tensor (which the custom ops receive as the same object) what made these
    lists: the mask_mod itself (a reference: its handle could be reused once it is freed), the
    block sizes and lengths, the four tensors and their versions, and a document mask's runs with
    its ids' version. The lists are the mask_mod's exactly as long as nobody writes into them.
    Tensors without version counters (made under inference mode) get no note."""
    try:
        versions = [a._version for a in arrs]
        doc = None
        if host_mod is not None and Q_LEN == KV_LEN and _L.nsa_flex_route_without_lists(host_mod.ptr, None) == 2:
            import numpy as np
            runs, idx = np.zeros(Q_LEN + 1, np.int32), ctypes.c_int32(-1)
            n = _L.nsa_flex_doc_runs(host_mod.ptr, Q_LEN, runs.ctypes.data, ctypes.byref(idx))
            ids = mod._arrays[idx.value] if n > 0 else None
            if _is_torch_tensor(ids):
                doc = (ids, ids._version, runs[:n + 1], n)
    except RuntimeError:  # (inference tensors have no version counter)
        return
    arrs[0]._nsa_made = (mod, tuple(block), Q_LEN, KV_LEN, arrs[1:], versions, doc)


def _lists_add_nothing(block_mask, q, k, mask, score):
    """Whether this call may leave out block_mask's lists: create_block_mask made them on a GPU for
    this mask_mod and these lengths, none has been written since, and the mods are attention
    options that the dense route takes from the mods alone (nsa_flex_route_without_lists), or
    with a document mask from the mods and its ids' runs, known since create_block_mask read the
    ids and unchanged since. The lists then add nothing to what the mask_mod shows, and passing
    them (or no runs) would cost the call a copy to the host and a synchronisation of the stream.
    @return None (pass the lists), () (leave them out) or (runs, n) (leave them out, pass the
    runs as doc_runs)."""
    counts = block_mask.kv_num_blocks
    made = getattr(counts, "_nsa_made", None) if _is_torch_tensor(counts) else None
    if made is None or not _is_torch_tensor(q) or q.device.type != "cuda":
        return None
    made_mod, block, Tq, Tk, others, versions, doc = made
    lists = (counts, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    if made_mod is not mask or tuple(block_mask.BLOCK_SIZE) != block or (Tq, Tk) != (q.shape[2], k.shape[2]) or Tq != Tk:
        return None
    # (the lists' batch and head dims as the call checks them: a mismatch is refused there)
    if counts.shape[0] not in (1, q.shape[0]) or counts.shape[1] not in (1, q.shape[1]):
        return None
    try:
        if any(x is not a for x, a in zip(lists[1:], others)) or any(x._version != v for x, v in zip(lists, versions)):
            return None
        kind = _L.nsa_flex_route_without_lists(mask.ptr if mask else None, score.ptr if score else None)
        if kind == 1:
            return ()
        # a document mask: one batch entry (varlen), its ids those create_block_mask read
        if kind == 2 and doc is not None and q.shape[0] == 1 and any(doc[0] is a for a in mask._arrays) and \
                doc[0]._version == doc[1]:
            return (doc[2], doc[3])
    except RuntimeError:
        return None
    return None


def _wants_torch(device):
    if device is None:
        return False
    if type(device).__module__.startswith("torch"):
        return True
    import importlib.util
    return importlib.util.find_spec("torch") is not None


# ---- the call -------------------------------------------------------------------------------------

def _bthd(x):
    """[B, H, T, D] -> the [B, T, H, D] view (no copy)."""
    return x.transpose(1, 2) if _is_torch_tensor(x) else x.transpose(0, 2, 1, 3)


def _int32_like(x, q):
    """A block-mask list as int32 in q's library and device (None stays None)."""
    if x is None:
        return None
    if _is_torch_tensor(q):
        import torch
        x = x if _is_torch_tensor(x) else torch.from_numpy(__import__("numpy").asarray(x))
        return x.to(device=q.device, dtype=torch.int32)
    import numpy as np
    x = x.cpu().numpy() if _is_torch_tensor(x) else x
    return np.asarray(x, np.int32)


def _fill(call, a, q, k, v, block_mask, score, mask, scale):
    a.q, a.k, a.v = call.view(_bthd(q), "q"), call.view(_bthd(k), "k"), call.view(_bthd(v), "v")
    bm = a.block_mask
    bm.q_block, bm.kv_block = block_mask.BLOCK_SIZE if block_mask is not None else (128, 128)
    spare = _lists_add_nothing(block_mask, q, k, mask, score) if block_mask is not None else None
    if spare:  # (a document mask's runs instead of the lists)
        a.doc_runs, a.num_doc_runs = spare[0].ctypes.data, spare[1]
    elif spare is None and block_mask is not None:
        lists = [_int32_like(x, q) for x in (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                                              block_mask.full_kv_indices)]
        for name, x in zip(("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"), lists):
            if x is not None:
                setattr(bm, name, call.view(x, "block_mask." + name))
    a.mask_mod = mask.ptr if mask else None
    a.score_mod = score.ptr if score else None
    a.scale = float(scale or 0.0)


def _forward(q, k, v, block_mask, score, scale):
    call = _core.NumpyCall() if not _is_torch_tensor(q) else _torch_call(q)
    a = _lib.FlexArgs()
    mask = block_mask.mask_mod if block_mask is not None else None
    _fill(call, a, q, k, v, block_mask, score, mask, scale)
    B, HQ, Tq = q.shape[0], q.shape[1], q.shape[2]
    # o allocated in the layout returned ([B, HQ, Tq, Dv]) and written through its [B, T, H, D]
    # view, so no copy follows the call (lse's rows need a unit last stride: [B, T, H])
    o = call.empty((B, HQ, Tq, v.shape[3]), call.dtype(q))
    lse = call.empty((B, Tq, HQ), "f32")
    a.o, a.lse = call.view(_bthd(o), "o", output=True), call.view(lse, "lse", output=True)
    call.run("flex_attention", a)
    return o, _bthd_rows(lse)


def _bthd_rows(lse):
    """[B, T, H] -> [B, H, T] view."""
    return lse.transpose(1, 2) if _is_torch_tensor(lse) else lse.transpose(0, 2, 1)


def _backward(q, k, v, o, lse, dout, block_mask, score, scale, want):
    """dq, dk, dv ([B, H, T, D]) and {tensor index: f32 gradient} of the score_mod's float tensors in `want`."""
    call = _core.NumpyCall() if not _is_torch_tensor(q) else _torch_call(q)
    g = _lib.FlexBwdArgs()
    mask = block_mask.mask_mod if block_mask is not None else None
    _fill(call, g.fwd, q, k, v, block_mask, score, mask, scale)
    g.fwd.o, g.fwd.lse = call.view(_bthd(o), "fwd.o"), call.view(lse.transpose(1, 2) if _is_torch_tensor(lse)
                                                                  else lse.transpose(0, 2, 1), "fwd.lse")
    g.dout = call.view(_bthd(dout), "dout")
    grads = [call.empty(tuple(x.shape), call.dtype(x)) for x in (q, k, v)]  # (as the forward's o)
    g.dq, g.dk, g.dv = (call.view(_bthd(x), n, output=True) for x, n in zip(grads, ("dq", "dk", "dv")))
    tens = {}
    for i in want:
        t = call.empty(tuple(score._arrays[i].shape), "f32")
        tens[i] = t
        g.dscore_tensors[i] = call.view(t, "dscore_tensors[%d]" % i, output=True)
    call.run("flex_attention_bwd", g)
    return tuple(grads), tens


def flex_attention(query: Array, key: Array, value: Array, score_mod: ModLike = None,
                   block_mask: Optional[BlockMask] = None, scale: Optional[float] = None, enable_gqa: bool = False,
                   return_lse: bool = False, tensors: Optional[Dict[str, Array]] = None):
    """FlexAttention's call: query [B, HQ, Tq, D], key / value [B, H, Tk, D] (H < HQ needs
    enable_gqa), score_mod(score, b, h, q_idx, kv_idx) a callable or expression string,
    block_mask from create_block_mask (its mask_mod applies to partial blocks). Returns o
    [B, HQ, Tq, Dv] (and lse [B, HQ, Tq] float32 with return_lse). numpy on the CPU, or torch
    tensors on the CPU or a GPU with autograd (q, k, v and the float tensors the score_mod reads).
    Mods that are nsa.attention options -- causal, sliding or two-sided windows, documents
    (doc[q_idx] == doc[kv_idx]), a tanh softcap -- with Tq == Tk and the block mask
    create_block_mask makes run on nsa.attention's kernels (docs/spec.md 14, the dense route)."""
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError("query has %d heads, key %d: pass enable_gqa=True" % (query.shape[1], key.shape[1]))
    score = score_mod if isinstance(score_mod, Mod) or score_mod is None else Mod(score_mod, "score_mod", tensors)
    if _is_torch_tensor(query):
        return _flex_torch(query, key, value, score, block_mask, scale, return_lse)
    o, lse = _forward(query, key, value, block_mask, score, scale)
    return (o, lse) if return_lse else o


def _flex_torch(q, k, v, score, block_mask, scale, return_lse):
    """torch tensors: the custom op nsa::flex_fwd (autograd to q, k, v and the score_mod's float tensors)."""
    from ._torch_flex import flex_eager, flex_op
    op = flex_op()  # (registered on the first call, eager or not: a compiled call cannot register it)
    lists = [None] * 4
    mask_handle, qb, kb = 0, 128, 128
    if block_mask is not None:
        qb, kb = block_mask.BLOCK_SIZE
        lists = [_int32_like(x, q) for x in (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                                            block_mask.full_kv_indices)]
        mask_handle = block_mask.mask_mod.handle if block_mask.mask_mod is not None else 0
    floats = list(score.float_list) if score is not None else []
    score_handle = score.handle if score is not None else 0
    got = flex_eager(q, k, v, lists, floats, mask_handle, score_handle, int(qb), int(kb), float(scale or 0.0))
    o, lse = got if got is not None else op(q, k, v, *lists, floats, mask_handle, score_handle, int(qb), int(kb),
                                            float(scale or 0.0))
    return (o, lse) if return_lse else o
