"""ctypes mirror of include/nsa.h: the loader, every struct field by field, every prototype.

Nothing here knows about numpy or torch. tests/python/test_abi.py compiles a tiny C program
against nsa.h and checks that every size and field offset below matches the C compiler's.
"""
import ctypes
import os
from ctypes import POINTER, Structure, c_char_p, c_float, c_int, c_int32, c_int64, c_size_t, c_uint64, c_void_p

_HERE = os.path.dirname(os.path.abspath(__file__))


# ---- the shared library: next to the package, in the repository's build/, or NSA_LIBRARY ----

def _candidates():
    env = os.environ.get("NSA_LIBRARY")
    if env:
        yield env
    yield os.path.join(_HERE, "libnsa.so")
    yield os.path.join(_HERE, "..", "..", "build", "libnsa.so")


def _load():
    env = os.environ.get("NSA_LIBRARY")
    if env and not os.path.exists(env):  # a named library is the one wanted: no silent fallback
        raise ImportError("nsa: NSA_LIBRARY names %s, which does not exist" % os.path.abspath(env))
    tried = []
    for path in _candidates():
        path = os.path.abspath(path)
        if os.path.exists(path):
            lib = ctypes.CDLL(path)
            _declare(lib)
            return lib, path
        tried.append(path)
    raise ImportError("nsa: libnsa.so not found (run `make`, or set NSA_LIBRARY); looked in " + ", ".join(tried))


# ---- enums (nsa.h values; stable) --------------------------------------------------------

STATUS_NAMES = (
    "SUCCESS", "NULL_POINTER", "BAD_RANK", "BAD_SHAPE", "BAD_STRIDE", "BAD_DTYPE", "BAD_GQA",
    "BAD_CMP_STRIDE", "BAD_CMP_LEN", "BAD_SLC_BLOCK", "BAD_TOPK", "BAD_WINDOW", "BAD_SCALE",
    "BAD_CU_SEQLENS", "SIZE_OVERFLOW", "WORKSPACE_TOO_SMALL", "BACKEND_UNAVAILABLE",
    "NOT_SUPPORTED", "OUT_OF_MEMORY", "DEVICE_ERROR", "BAD_ARGUMENT", "MISSING_OUTPUT",
    "BAD_SOFTCAP", "BAD_DROPOUT", "BAD_EXPRESSION",
)
for _code, _name in enumerate(STATUS_NAMES):
    globals()["STATUS_" + _name] = _code

DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_I32, DTYPE_U8 = 0, 1, 2, 3, 4
BACKEND_CPU, BACKEND_CUDA = 0, 1
MAX_RANK = 4


# ---- structs -------------------------------------------------------------------------------

class Tensor(Structure):
    """nsa_tensor: data, dtype, rank, shape[4], stride[4] (strides in elements)."""
    _fields_ = [
        ("data", c_void_p),
        ("dtype", c_int),
        ("rank", c_int32),
        ("shape", c_int64 * MAX_RANK),
        ("stride", c_int64 * MAX_RANK),
    ]


class Config(Structure):
    _fields_ = [
        ("cmp_len", c_int64),
        ("cmp_stride", c_int64),
        ("slc_block", c_int64),
        ("slc_topk", c_int64),
        ("n_init", c_int64),
        ("n_local", c_int64),
        ("window", c_int64),
        ("scale", c_float),
        ("swa_scale", c_float),
    ]


class Varlen(Structure):
    _fields_ = [("cu_seqlens", POINTER(c_int32)), ("num_seqs", c_int64)]


class ContextDesc(Structure):
    _fields_ = [
        ("backend", c_int),
        ("num_threads", c_int32),
        ("device", c_int32),
        ("stream", c_void_p),
    ]


class CompressArgs(Structure):
    _fields_ = [("x", Tensor), ("x_cmp", Tensor), ("varlen", Varlen), ("config", Config)]


class CompressBwdArgs(Structure):
    _fields_ = [("fwd", CompressArgs), ("dx_cmp", Tensor), ("dx", Tensor)]


class CmpAttnArgs(Structure):
    _fields_ = [
        ("q", Tensor), ("k_cmp", Tensor), ("v_cmp", Tensor), ("o", Tensor), ("lse", Tensor),
        ("varlen", Varlen), ("config", Config), ("kv_len", c_int64),
    ]


class CmpAttnBwdArgs(Structure):
    _fields_ = [("fwd", CmpAttnArgs), ("dout", Tensor), ("dq", Tensor), ("dk_cmp", Tensor), ("dv_cmp", Tensor)]


class SelectArgs(Structure):
    _fields_ = [
        ("q", Tensor), ("k_cmp", Tensor), ("lse_cmp", Tensor), ("block_indices", Tensor),
        ("block_counts", Tensor), ("varlen", Varlen), ("config", Config), ("kv_len", c_int64),
    ]


class SlcAttnArgs(Structure):
    _fields_ = [
        ("q", Tensor), ("k", Tensor), ("v", Tensor), ("block_indices", Tensor), ("block_counts", Tensor),
        ("o", Tensor), ("lse", Tensor), ("varlen", Varlen), ("config", Config),
    ]


class SlcAttnBwdArgs(Structure):
    _fields_ = [("fwd", SlcAttnArgs), ("dout", Tensor), ("dq", Tensor), ("dk", Tensor), ("dv", Tensor)]


class VarlenQK(Structure):
    _fields_ = [("cu_seqlens_q", POINTER(c_int64)), ("cu_seqlens_k", POINTER(c_int64)), ("num_seqs", c_int64)]


class AttentionArgs(Structure):
    _fields_ = [
        ("q", Tensor), ("k", Tensor), ("v", Tensor), ("o", Tensor), ("lse", Tensor), ("varlen", Varlen),
        ("scale", c_float), ("causal", c_int32), ("window_left", c_int64), ("window_right", c_int64),
        # appended in 0.2: zero = off
        ("softcap", c_float), ("sinks", Tensor), ("q_segment_ids", Tensor), ("k_segment_ids", Tensor),
        ("bias", Tensor), ("mask", Tensor), ("dropout_p", c_float), ("dropout_seed", c_uint64),
        ("dropout_offset", c_uint64), ("varlen_qk", VarlenQK),
    ]


class AttentionBwdArgs(Structure):
    _fields_ = [("fwd", AttentionArgs), ("dout", Tensor), ("dq", Tensor), ("dk", Tensor), ("dv", Tensor),
                ("dsinks", Tensor), ("dbias", Tensor)]


class GateArgs(Structure):
    _fields_ = [
        ("o_cmp", Tensor), ("o_slc", Tensor), ("o_swa", Tensor),
        ("g_cmp", Tensor), ("g_slc", Tensor), ("g_swa", Tensor),
        ("o", Tensor),
    ]


class GateBwdArgs(Structure):
    _fields_ = [
        ("fwd", GateArgs), ("dout", Tensor),
        ("do_cmp", Tensor), ("do_slc", Tensor), ("do_swa", Tensor),
        ("dg_cmp", Tensor), ("dg_slc", Tensor), ("dg_swa", Tensor),
    ]


class Saved(Structure):
    _fields_ = [
        ("block_indices", Tensor),
        ("o_cmp", Tensor), ("o_slc", Tensor), ("o_swa", Tensor),
        ("lse_cmp", Tensor), ("lse_slc", Tensor), ("lse_swa", Tensor),
    ]


class ForwardArgs(Structure):
    _fields_ = [
        ("q", Tensor),
        ("k", Tensor), ("v", Tensor),
        ("k_slc", Tensor), ("v_slc", Tensor),
        ("k_swa", Tensor), ("v_swa", Tensor),
        ("k_cmp", Tensor), ("v_cmp", Tensor),
        ("g_cmp", Tensor), ("g_slc", Tensor), ("g_swa", Tensor),
        ("block_indices", Tensor),
        ("block_counts", Tensor),
        ("o", Tensor),
        ("saved", Saved),
        ("varlen", Varlen),
        ("config", Config),
    ]


class BackwardArgs(Structure):
    _fields_ = [
        ("fwd", ForwardArgs),
        ("dout", Tensor),
        ("dq", Tensor),
        ("dk", Tensor), ("dv", Tensor),
        ("dk_slc", Tensor), ("dv_slc", Tensor),
        ("dk_swa", Tensor), ("dv_swa", Tensor),
        ("dk_cmp", Tensor), ("dv_cmp", Tensor),
        ("dg_cmp", Tensor), ("dg_slc", Tensor), ("dg_swa", Tensor),
    ]


class KvCache(Structure):
    _fields_ = [("k", Tensor), ("v", Tensor), ("block_table", Tensor)]


class StepArgs(Structure):
    _fields_ = [
        ("q", Tensor),
        ("q_lens", Tensor),
        ("seqlens", Tensor),
        ("k_new", Tensor), ("v_new", Tensor),
        ("cache", KvCache),
        ("cmp_cache", KvCache),
        ("cmp_by_caller", c_int32),
        ("g_cmp", Tensor), ("g_slc", Tensor), ("g_swa", Tensor),
        ("block_indices", Tensor),
        ("block_counts", Tensor),
        ("o", Tensor),
        ("selected", Tensor),
        ("errors", Tensor),
        ("config", Config),
    ]


class AttentionStepArgs(Structure):
    _fields_ = [
        ("q", Tensor),
        ("q_lens", Tensor),
        ("seqlens", Tensor),
        ("k_new", Tensor), ("v_new", Tensor),
        ("cache", KvCache),
        ("o", Tensor),
        ("lse", Tensor),
        ("errors", Tensor),
        ("scale", c_float),
        ("causal", c_int32),
        ("window_left", c_int64),
        ("window_right", c_int64),
        ("softcap", c_float),
        ("sinks", Tensor),
    ]


class ModTensor(Structure):
    _fields_ = [("name", c_char_p), ("tensor", Tensor)]


MOD_MAX_TENSORS = 16


class BlockMask(Structure):
    _fields_ = [
        ("q_block", c_int64), ("kv_block", c_int64),
        ("kv_num_blocks", Tensor), ("kv_indices", Tensor),
        ("full_kv_num_blocks", Tensor), ("full_kv_indices", Tensor),
    ]


class FlexArgs(Structure):
    _fields_ = [
        ("q", Tensor), ("k", Tensor), ("v", Tensor),
        ("o", Tensor), ("lse", Tensor),
        ("block_mask", BlockMask),
        ("mask_mod", c_void_p), ("score_mod", c_void_p),
        ("scale", c_float),
        ("doc_runs", c_void_p), ("num_doc_runs", c_int64),
    ]


class FlexBwdArgs(Structure):
    _fields_ = [
        ("fwd", FlexArgs),
        ("dout", Tensor), ("dq", Tensor), ("dk", Tensor), ("dv", Tensor),
        ("dscore_tensors", Tensor * MOD_MAX_TENSORS),
    ]


# Every struct of nsa.h, by its C name (the ABI test walks this table).
STRUCTS = {
    "nsa_tensor": Tensor,
    "nsa_config": Config,
    "nsa_varlen": Varlen,
    "nsa_context_desc": ContextDesc,
    "nsa_compress_args": CompressArgs,
    "nsa_compress_bwd_args": CompressBwdArgs,
    "nsa_cmp_attn_args": CmpAttnArgs,
    "nsa_cmp_attn_bwd_args": CmpAttnBwdArgs,
    "nsa_select_args": SelectArgs,
    "nsa_slc_attn_args": SlcAttnArgs,
    "nsa_slc_attn_bwd_args": SlcAttnBwdArgs,
    "nsa_varlen_qk": VarlenQK,
    "nsa_attention_args": AttentionArgs,
    "nsa_attention_bwd_args": AttentionBwdArgs,
    "nsa_gate_args": GateArgs,
    "nsa_gate_bwd_args": GateBwdArgs,
    "nsa_saved": Saved,
    "nsa_forward_args": ForwardArgs,
    "nsa_backward_args": BackwardArgs,
    "nsa_kv_cache": KvCache,
    "nsa_step_args": StepArgs,
    "nsa_attention_step_args": AttentionStepArgs,
    "nsa_mod_tensor": ModTensor,
    "nsa_block_mask": BlockMask,
    "nsa_flex_args": FlexArgs,
    "nsa_flex_bwd_args": FlexBwdArgs,
}

# op name -> its args struct; each has nsa_<op>_workspace_size and nsa_<op>.
OPS = {
    "compress": CompressArgs,
    "compress_bwd": CompressBwdArgs,
    "cmp_attn": CmpAttnArgs,
    "cmp_attn_bwd": CmpAttnBwdArgs,
    "select": SelectArgs,
    "slc_attn": SlcAttnArgs,
    "slc_attn_bwd": SlcAttnBwdArgs,
    "attention": AttentionArgs,
    "attention_bwd": AttentionBwdArgs,
    "gate": GateArgs,
    "gate_bwd": GateBwdArgs,
    "forward": ForwardArgs,
    "backward": BackwardArgs,
    "step": StepArgs,
    "attention_step": AttentionStepArgs,
    "flex_attention": FlexArgs,
    "flex_attention_bwd": FlexBwdArgs,
}


def _declare(lib):
    """argtypes/restype of every function in nsa.h (ctypes would otherwise guess int)."""
    def fn(name, restype, *argtypes):
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = list(argtypes)

    fn("nsa_status_string", c_char_p, c_int)
    fn("nsa_last_error_detail", c_char_p)
    fn("nsa_version_number", c_int)
    fn("nsa_version_string", c_char_p)
    fn("nsa_tensor_make", Tensor, c_void_p, c_int, c_int32, POINTER(c_int64))
    fn("nsa_tensor_3d", Tensor, c_void_p, c_int, c_int64, c_int64, c_int64)
    fn("nsa_tensor_4d", Tensor, c_void_p, c_int, c_int64, c_int64, c_int64, c_int64)
    fn("nsa_dtype_size", c_size_t, c_int)
    fn("nsa_config_default", Config)
    fn("nsa_config_validate", c_int, POINTER(Config))
    fn("nsa_num_cmp_blocks", c_int64, POINTER(Config), c_int64)
    fn("nsa_num_slc_blocks", c_int64, POINTER(Config), c_int64)
    fn("nsa_cmp_offsets", c_int, POINTER(Config), POINTER(c_int32), c_int64, POINTER(c_int64))
    fn("nsa_backend_available", c_int, c_int)
    fn("nsa_context_create", c_int, POINTER(c_void_p), POINTER(ContextDesc))
    fn("nsa_context_set_stream", c_int, c_void_p, c_void_p)
    fn("nsa_context_backend", c_int, c_void_p)
    fn("nsa_context_destroy", None, c_void_p)
    fn("nsa_mod_create", c_int, POINTER(c_void_p), c_int, c_char_p, POINTER(ModTensor), c_int32)
    fn("nsa_mod_destroy", None, c_void_p)
    fn("nsa_create_block_mask", c_int, c_void_p, c_int64, c_int64, POINTER(BlockMask))
    fn("nsa_flex_route_without_lists", c_int, c_void_p, c_void_p)
    fn("nsa_flex_doc_runs", c_int64, c_void_p, c_int64, c_void_p, POINTER(c_int32))
    for op, args in OPS.items():
        fn("nsa_%s_workspace_size" % op, c_int, c_void_p, POINTER(args), POINTER(c_size_t))
        fn("nsa_" + op, c_int, c_void_p, POINTER(args), c_void_p, c_size_t)


library, library_path = _load()
