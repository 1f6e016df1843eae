"""numpy arrays on the CPU backend: outputs, saved branch outputs, selection and gradients
against the naive reference of nsa_ref.py (float64), with the tolerance rule of helpers.py;
the fla-compatible call; strided views; bad input."""
import dataclasses
import numpy as np
import pytest

import nsa
import nsa_ref as ref
from helpers import check_close, rand_inputs, selection_agrees

BR = ("cmp", "slc", "swa")

# (id, B, T, HQ, H, DK, DV, config, gates, cu_seqlens)
CASES = [
    ("small-paper", 2, 100, 4, 2, 16, 8, nsa.Config(16, 8, 32, 4, 1, 2, 24), BR, None),
    ("fla-like", 1, 70, 4, 1, 16, 16, nsa.Config(16, 16, 16, 3, 1, 2, 20), BR, None),
    ("paper-cfg", 1, 150, 2, 1, 8, 8, nsa.Config(), BR, None),
    ("G1-T1", 1, 1, 2, 2, 8, 8, nsa.Config(4, 2, 8, 3, 1, 2, 4), BR, None),
    ("T<l", 2, 10, 4, 2, 8, 4, nsa.Config(16, 8, 16, 3, 1, 2, 5), BR, None),
    ("n>candidates", 1, 40, 8, 2, 8, 8, nsa.Config(8, 4, 16, 8, 1, 2, 9), BR, None),
    ("G4-dk!=dv", 1, 77, 8, 2, 12, 20, nsa.Config(8, 4, 8, 5, 2, 1, 13, 0.3), BR, None),
    ("varlen", 1, 90, 4, 2, 8, 8, nsa.Config(8, 4, 16, 3, 1, 2, 10), BR, [0, 0, 1, 37, 37, 90]),
    ("cmp-only", 1, 60, 2, 1, 8, 8, nsa.Config(8, 4, 16, 3, 1, 2, 10), ("cmp",), None),
    ("slc-only", 1, 60, 2, 1, 8, 8, nsa.Config(8, 4, 16, 3, 1, 2, 10), ("slc",), None),
    ("swa-only", 1, 60, 2, 1, 8, 8, nsa.Config(8, 4, 16, 3, 1, 2, 10), ("swa",), None),
]


def _ref_cfg(config):
    return ref.Cfg.of(config)


def _grads_and_check(res, x, ref64, ref32, dout, seed):
    grads = res.backward(dout)
    g64, g32 = ref64["backward"](dout), ref32["backward"](dout)
    for name, want in g64.items():
        got = getattr(grads, name)
        assert got is not None, name
        assert got.dtype == x[name].dtype if name in x else True
        check_close("d" + name, got, want, g32[name], seed=seed)
    for name in nsa.Grads._fields:
        if name not in g64:
            assert getattr(grads, name) is None, name


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_backward_vs_reference(case):
    name, B, T, HQ, H, DK, DV, config, gates, cu = case
    seed = abs(hash(name)) % 10000
    x = rand_inputs(seed, B, T, HQ, H, DK, DV, gates=gates)
    res = nsa.forward(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=config, cu_seqlens=cu)
    assert res.o.shape == (B, T, HQ, DV) and res.o.dtype == np.float32
    cfg = _ref_cfg(config)
    ref_sel = ref.nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], cfg, cu_seqlens=cu)
    if "slc" in gates:
        assert res.aux.block_indices.shape == (B, T, H, config.slc_topk)
        seqs = ref.sequences(B, T, cu)
        for (b, s, e), imp in zip(seqs, ref_sel["importance"]):
            selection_agrees(res.aux.block_indices[b, s:e], ref_sel["block_indices"][b, s:e],
                             lambda t, h: imp[h, t], None)
    else:
        assert res.aux.block_indices is None
    # outputs and gradients on the library's selection (near ties may pick other blocks)
    sel = res.aux.block_indices
    r64 = ref.nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], cfg, block_indices=sel, cu_seqlens=cu)
    r32 = ref.nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], cfg, block_indices=sel, cu_seqlens=cu,
                  dtype=np.float32)
    check_close("o", res.o, r64["o"], r32["o"], seed=seed)
    for br in BR:
        if br in gates:
            check_close("o_" + br, getattr(res.aux, "o_" + br), r64["o_" + br], r32["o_" + br], seed=seed)
            check_close("lse_" + br, getattr(res.aux, "lse_" + br), r64["lse_" + br], r32["lse_" + br], seed=seed)
            assert getattr(res.aux, "o_" + br).dtype == np.float32  # saved in float32 (documented)
        else:
            assert getattr(res.aux, "o_" + br) is None
    dout = np.random.default_rng(seed + 1).standard_normal(res.o.shape).astype(np.float32)
    _grads_and_check(res, x, r64, r32, dout, seed)


def test_native_sparse_attention_numpy_matches_forward():
    x = rand_inputs(3, 1, 50, 4, 2, 8, 8)
    cfg = nsa.Config(8, 4, 16, 3, 1, 2, 10)
    o = nsa.native_sparse_attention(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg)
    o2, aux = nsa.native_sparse_attention(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg,
                                          return_aux=True)
    np.testing.assert_array_equal(o, o2)
    assert isinstance(aux, nsa.Aux) and aux.block_indices.dtype == np.int32
    res = nsa.forward(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg)
    np.testing.assert_array_equal(o, res.o)


def test_caller_compression_and_selection():
    """k_cmp/v_cmp from the caller (gradients flow to them), caller block_indices with -1,
    out-of-range, future and repeated entries, and per-row block_counts."""
    B, T, HQ, H, D = 1, 64, 4, 2, 8
    cfg = nsa.Config(8, 4, 16, 4, 1, 2, 12)
    x = rand_inputs(11, B, T, HQ, H, D, D)
    rng = np.random.default_rng(12)
    nc = cfg.num_cmp_blocks(T)
    k_cmp = rng.standard_normal((B, nc, H, D)).astype(np.float32)
    v_cmp = rng.standard_normal((B, nc, H, D)).astype(np.float32)
    idx = rng.integers(-2, 6, (B, T, H, 5)).astype(np.int64)  # -1/-2, >= nb, future, repeats; int64 accepted
    idx[..., 0] = idx[..., 1]                                # duplicates count once
    counts = rng.integers(-1, 7, (B, T, H)).astype(np.int32)  # clamped to [0, m]
    res = nsa.forward(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg, k_cmp=k_cmp,
                      v_cmp=v_cmp, block_indices=idx, block_counts=counts)
    assert res.aux.block_indices is None  # nothing selected: the caller's indices were used
    rc = ref.Cfg.of(cfg)
    kw = dict(k_cmp=k_cmp, v_cmp=v_cmp, block_indices=idx, block_counts=counts)
    r64 = ref.nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], rc, **kw)
    r32 = ref.nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], rc, dtype=np.float32, **kw)
    check_close("o", res.o, r64["o"], r32["o"])
    dout = rng.standard_normal(res.o.shape).astype(np.float32)
    x.update(k_cmp=k_cmp, v_cmp=v_cmp)
    _grads_and_check(res, x, r64, r32, dout, 11)


def test_separate_branch_kv():
    B, T, HQ, H, D = 1, 48, 4, 2, 8
    cfg = nsa.Config(8, 4, 8, 3, 1, 2, 7)
    x = rand_inputs(21, B, T, HQ, H, D, D)
    rng = np.random.default_rng(22)
    extra = {n: rng.standard_normal((B, T, H, D)).astype(np.float32) for n in ("k_slc", "v_slc", "k_swa", "v_swa")}
    res = nsa.forward(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg, **extra)
    sel = res.aux.block_indices
    rc = ref.Cfg.of(cfg)
    r64 = ref.nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], rc, block_indices=sel, **extra)
    r32 = ref.nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], rc, block_indices=sel,
                  dtype=np.float32, **extra)
    check_close("o", res.o, r64["o"], r32["o"])
    x.update(extra)
    _grads_and_check(res, x, r64, r32, rng.standard_normal(res.o.shape).astype(np.float32), 21)


def test_strided_views():
    """Non-contiguous inputs (slices, transposes) give the same result as contiguous copies."""
    B, T, HQ, H, D = 2, 40, 4, 2, 8
    cfg = nsa.Config(8, 4, 8, 3, 1, 2, 9)
    rng = np.random.default_rng(5)
    big_q = rng.standard_normal((B, T, 2 * HQ, D + 3)).astype(np.float32)
    q = big_q[:, :, ::2, 1:D + 1]                                           # strided heads and dims
    k = np.ascontiguousarray(rng.standard_normal((B, H, T, D)).astype(np.float32)).transpose(0, 2, 1, 3)
    v = rng.standard_normal((T, B, H, D)).astype(np.float32).transpose(1, 0, 2, 3)
    g = rng.uniform(size=(B, HQ, T)).astype(np.float32).transpose(0, 2, 1)
    assert not q.flags.c_contiguous and not k.flags.c_contiguous and not g.flags.c_contiguous
    a = nsa.forward(q, k, v, g, g, g, config=cfg)
    c = [np.ascontiguousarray(t) for t in (q, k, v, g)]
    b = nsa.forward(c[0], c[1], c[2], c[3], c[3], c[3], config=cfg)
    np.testing.assert_array_equal(a.o, b.o)
    dout = rng.standard_normal(a.o.shape).astype(np.float32)[:, ::-1][:, ::-1]  # a reversed-and-back view
    ga, gb = a.backward(dout), b.backward(np.ascontiguousarray(dout))
    for n in ("q", "k", "v", "g_cmp"):
        np.testing.assert_array_equal(getattr(ga, n), getattr(gb, n))
    # an innermost stride != 1 is copied for inputs
    q2 = np.asfortranarray(c[0])
    np.testing.assert_array_equal(nsa.forward(q2, c[1], c[2], c[3], c[3], c[3], config=cfg).o, b.o)


def test_float16():
    """float16 storage (fp32 accumulation) within the tolerance rule of a float16 naive version."""
    B, T, HQ, H, D = 1, 60, 4, 2, 8
    cfg = nsa.Config(8, 4, 16, 3, 1, 2, 10)
    x = rand_inputs(31, B, T, HQ, H, D, D, dtype=np.float16)
    res = nsa.forward(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg)
    assert res.o.dtype == np.float16
    sel = res.aux.block_indices
    rc = ref.Cfg.of(cfg)
    r64 = ref.nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], rc, block_indices=sel)
    r16 = ref.nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], rc, block_indices=sel,
                  dtype=np.float16)
    check_close("o", res.o, r64["o"], r16["o"], floor=2e-3)
    dout = np.random.default_rng(32).standard_normal(res.o.shape).astype(np.float16)
    grads = res.backward(dout)
    g64, g16 = r64["backward"](dout), r16["backward"](dout)
    for n in ("q", "k", "v", "g_cmp", "g_slc", "g_swa"):
        assert getattr(grads, n).dtype == np.float16
        check_close("d" + n, getattr(grads, n), g64[n], g16[n], floor=2e-3)


def test_compress_and_select():
    B, T, H, HQ, D = 2, 75, 2, 4, 8
    cfg = nsa.Config(16, 8, 32, 3, 1, 1, 10)
    x = rand_inputs(41, B, T, HQ, H, D, D)
    kc = nsa.compress(x["k"], cfg)
    pool = ref.pool_matrix(T, 16, 8)
    want = np.einsum("ct,bthd->bchd", pool, x["k"].astype(np.float64))
    assert kc.shape == want.shape
    check_close("k_cmp", kc, want, np.einsum("ct,bthd->bchd", pool.astype(np.float32), x["k"]))
    idx, cnt = nsa.select(x["q"], kc, cfg, return_counts=True)
    assert idx.shape == (B, T, H, 3) and cnt.shape == (B, T, H)
    np.testing.assert_array_equal(cnt, (idx >= 0).sum(-1))
    r = ref.nsa(x["q"], x["k"], x["v"], None, np.ones((B, T, HQ)), None, ref.Cfg.of(cfg))
    for b in range(B):
        selection_agrees(idx[b], r["block_indices"][b], lambda t, h: r["importance"][b][h, t], None)
    # varlen compression packs the rows of every sequence (nsa.cmp_offsets)
    cu = [0, 20, 20, 75]
    kv = nsa.compress(x["k"][:1], cfg, cu_seqlens=cu)
    offs = nsa.cmp_offsets(cfg, cu)
    assert kv.shape[1] == offs[-1]
    for s in range(3):
        seg = x["k"][0, cu[s]:cu[s + 1]].astype(np.float64)
        want = np.einsum("ct,thd->chd", ref.pool_matrix(len(seg), 16, 8), seg)
        np.testing.assert_allclose(kv[0, offs[s]:offs[s + 1]], want, rtol=1e-5, atol=1e-6)


# ---- the fla-compatible call -----------------------------------------------------------------

FLA_CASES = [
    # (id, B, T, HQ, H, D, kwargs)
    ("all-branches", 2, 90, 4, 1, 16, dict(block_size=16, block_counts=3, window_size=20)),
    ("no-window", 1, 90, 4, 2, 16, dict(block_size=16, block_counts=4, window_size=0)),
    ("g_slc-none", 1, 70, 4, 2, 8, dict(block_size=8, block_counts=5, window_size=8, no_slc_gate=True)),
    ("varlen", 1, 100, 4, 2, 8, dict(block_size=8, block_counts=4, window_size=16, cu_seqlens=[0, 30, 31, 100])),
    ("scale", 1, 50, 2, 1, 8, dict(block_size=8, block_counts=3, window_size=8, scale=0.2)),
]


@pytest.mark.parametrize("case", FLA_CASES, ids=[c[0] for c in FLA_CASES])
def test_parallel_nsa_vs_reference(case):
    name, B, T, HQ, H, D, kw = case
    kw = dict(kw)
    no_slc_gate = kw.pop("no_slc_gate", False)
    x = rand_inputs(abs(hash(name)) % 1000, B, T, HQ, H, D, D)
    g_slc = None if no_slc_gate else x["g_slc"]
    o = nsa.parallel_nsa(x["q"], x["k"], x["v"], x["g_cmp"], g_slc, x["g_swa"], **kw)
    # the same call through native_sparse_attention on the fla config
    cfg = nsa.Config.fla(kw["block_size"], kw["block_counts"], kw["window_size"], kw.get("scale"))
    cfg = dataclasses.replace(cfg, swa_scale=D ** -0.5)  # fla's window scale, which parallel_nsa sets
    gs = np.ones_like(x["g_cmp"]) if no_slc_gate else g_slc
    o2, aux = nsa.native_sparse_attention(x["q"], x["k"], x["v"], x["g_cmp"], gs,
                                          x["g_swa"] if kw["window_size"] > 0 else None, config=cfg,
                                          cu_seqlens=kw.get("cu_seqlens"), return_aux=True)
    np.testing.assert_array_equal(o, o2)
    r64 = ref.fla_nsa(x["q"], x["k"], x["v"], x["g_cmp"], g_slc, x["g_swa"], block_indices=aux.block_indices, **kw)
    r32 = ref.fla_nsa(x["q"], x["k"], x["v"], x["g_cmp"], g_slc, x["g_swa"], block_indices=aux.block_indices,
                      dtype=np.float32, **kw)
    check_close("o", o, r64["o"], r32["o"])
    rs = ref.fla_nsa(x["q"], x["k"], x["v"], x["g_cmp"], g_slc, x["g_swa"], **kw)
    for (b, s, e), imp in zip(ref.sequences(B, T, kw.get("cu_seqlens")), rs["importance"]):
        selection_agrees(aux.block_indices[b, s:e], rs["block_indices"][b, s:e], lambda t, h: imp[h, t], None)


def test_parallel_nsa_caller_indices_and_counts():
    """fla semantics: g_cmp None skips the compressed branch (then block_indices are needed
    in fla); an int block_counts with caller indices is ignored (all entries read); a tensor
    block_counts limits each row."""
    B, T, HQ, H, D, bs = 1, 64, 4, 2, 8, 8
    x = rand_inputs(51, B, T, HQ, H, D, D)
    rng = np.random.default_rng(52)
    idx = np.sort(rng.integers(-1, 8, (B, T, H, 4)), -1)
    o = nsa.parallel_nsa(x["q"], x["k"], x["v"], None, x["g_slc"], None, block_indices=idx, block_counts=2,
                         block_size=bs)
    r = ref.fla_nsa(x["q"], x["k"], x["v"], None, x["g_slc"], None, block_indices=idx, block_counts=4,
                    block_size=bs)
    r32 = ref.fla_nsa(x["q"], x["k"], x["v"], None, x["g_slc"], None, block_indices=idx, block_counts=4,
                      block_size=bs, dtype=np.float32)
    check_close("o", o, r["o"], r32["o"])
    counts = rng.integers(0, 5, (B, T, H)).astype(np.int32)
    o = nsa.parallel_nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], None, block_indices=idx,
                         block_counts=counts, block_size=bs)
    cfg = ref.Cfg(bs, bs, bs, 4, 1, 2, 1)
    kw = dict(block_indices=idx, block_counts=counts)
    r = ref.nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], None, cfg, **kw)
    r32 = ref.nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], None, cfg, dtype=np.float32, **kw)
    check_close("o", o, r["o"], r32["o"])


def test_parallel_nsa_tensor_counts_selection():
    """block_counts [B, T, H] without block_indices: row (b, t, h) attends to its top-c blocks."""
    B, T, HQ, H, D, bs = 1, 96, 4, 2, 8, 8
    x = rand_inputs(61, B, T, HQ, H, D, D)
    counts = np.random.default_rng(62).integers(3, 7, (B, T, H)).astype(np.int32)
    o = nsa.parallel_nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], None, block_counts=counts, block_size=bs)
    # reference: for each count c the top-c selection of the reference, rows picked by count
    want = np.zeros((B, T, H, 6), np.int32) - 1
    for c in range(3, 7):
        r = ref.fla_nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], None, block_counts=c, block_size=bs)
        want = np.where((counts == c)[..., None], np.pad(r["block_indices"], ((0, 0),) * 3 + ((0, 6 - c),),
                                                         constant_values=-1), want)
    r64 = ref.fla_nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], None, block_indices=want, block_counts=6,
                      block_size=bs)
    r32 = ref.fla_nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], None, block_indices=want, block_counts=6,
                      block_size=bs, dtype=np.float32)
    check_close("o", o, r64["o"], r32["o"])


def test_parallel_nsa_argument_errors():
    x = rand_inputs(71, 1, 16, 2, 1, 8, 8)
    with pytest.raises(ValueError, match="g_swa"):
        nsa.parallel_nsa(x["q"], x["k"], x["v"], x["g_cmp"], None, None, block_size=8, window_size=4)
    with pytest.raises(ValueError, match="block_counts"):
        nsa.parallel_nsa(x["q"], x["k"], x["v"], x["g_cmp"], block_size=8, block_counts=None)
    with pytest.raises(NotImplementedError):
        nsa.parallel_nsa(x["q"], x["k"], x["v"], x["g_cmp"], block_size=8, cu_seqlens=([0, 16], [0, 16]))


# ---- bad input: a clear exception, outputs untouched ----------------------------------------------

def _bad(kind):
    B, T, HQ, H, D = 1, 32, 4, 2, 8
    x = rand_inputs(81, B, T, HQ, H, D, D)
    cfg = nsa.Config(8, 4, 8, 3, 1, 2, 8)
    kw = {}
    if kind == "BAD_DTYPE":
        x["k"] = x["k"].astype(np.float16)
    elif kind == "BAD_GQA":
        x["k"] = np.zeros((B, T, 3, D), np.float32)
        x["v"] = np.zeros((B, T, 3, D), np.float32)
    elif kind == "BAD_SHAPE":
        x["g_cmp"] = x["g_cmp"][:, :-1]
    elif kind == "BAD_CMP_STRIDE":
        cfg = nsa.Config(8, 3, 9, 3, 1, 2, 8)
    elif kind == "BAD_TOPK":
        cfg = nsa.Config(8, 4, 8, 2, 1, 2, 8)
    elif kind == "BAD_CU_SEQLENS":
        kw["cu_seqlens"] = [0, 10, 31]
    elif kind == "BAD_RANK":
        x["g_slc"] = x["g_slc"][..., None]
    elif kind == "BAD_ARGUMENT":
        x["g_cmp"] = x["g_slc"] = x["g_swa"] = None
    elif kind == "float64":
        x = {n: (a.astype(np.float64) if a is not None else None) for n, a in x.items()}
    return x, cfg, kw


@pytest.mark.parametrize("kind", ["BAD_DTYPE", "BAD_GQA", "BAD_SHAPE", "BAD_CMP_STRIDE", "BAD_TOPK",
                                  "BAD_CU_SEQLENS", "BAD_RANK", "BAD_ARGUMENT", "float64"])
def test_bad_input_raises_and_leaves_output(kind):
    x, cfg, kw = _bad(kind)
    q = x["q"]
    out = np.full(q.shape[:3] + (x["v"].shape[3],), 7.25, dtype=q.dtype)
    with pytest.raises(nsa.NsaError) as e:
        nsa.native_sparse_attention(q, x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg, out=out, **kw)
    want = "BAD_DTYPE" if kind == "float64" else kind
    assert e.value.name == want, str(e.value)
    assert e.value.detail and e.value.detail in str(e.value)
    assert str(e.value).endswith("(NSA_STATUS_%s)" % want)
    assert (out == 7.25).all()


def test_bad_output_buffer():
    x, cfg, _ = _bad(None)
    out = np.zeros((1, 32, 4, 8), np.float32)[..., ::-1]
    with pytest.raises(nsa.NsaError) as e:
        nsa.native_sparse_attention(x["q"], x["k"], x["v"], x["g_cmp"], None, None, config=cfg, out=out)
    assert e.value.name == "BAD_STRIDE"
    out = np.zeros((1, 32, 4, 9), np.float32)
    with pytest.raises(nsa.NsaError) as e:
        nsa.native_sparse_attention(x["q"], x["k"], x["v"], x["g_cmp"], None, None, config=cfg, out=out)
    assert e.value.name == "BAD_SHAPE"
    assert (out == 0).all()


def test_backward_bad_dout_leaves_nothing_half_done():
    x, cfg, _ = _bad(None)
    res = nsa.forward(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg)
    with pytest.raises(nsa.NsaError) as e:
        res.backward(np.zeros((1, 32, 4, 7), np.float32))
    assert e.value.name == "BAD_SHAPE" and e.value.op == "backward"


# ---- the reference itself: backward by finite differences ------------------------------------------

def test_reference_backward_finite_differences():
    """Backward two ways: the reference's hand-written backward against central differences of
    its own forward (fixed selection), float64, tiny shapes, every input."""
    B, T, HQ, H, D = 1, 12, 2, 1, 3
    cfg = ref.Cfg(4, 2, 4, 2, 1, 1, 5)
    x = rand_inputs(91, B, T, HQ, H, D, D, dtype=np.float64)
    rng = np.random.default_rng(92)
    kc = rng.standard_normal((B, ref.num_cmp(T, 4, 2), H, D))
    vc = rng.standard_normal(kc.shape)
    sel = ref.nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], cfg)["block_indices"]
    dout = rng.standard_normal((B, T, HQ, D))
    for use_kc in (False, True):
        args = dict(x)
        if use_kc:
            args.update(k_cmp=kc, v_cmp=vc)

        def loss(a):
            return (ref.nsa(cfg=cfg, block_indices=sel, **a)["o"] * dout).sum()

        grads = ref.nsa(cfg=cfg, block_indices=sel, **args)["backward"](dout)
        for name, g in grads.items():
            num = np.zeros_like(args[name])
            it = np.nditer(args[name], flags=["multi_index"])
            for _ in it:
                i = it.multi_index
                a = {n: (t.copy() if t is not None else None) for n, t in args.items()}
                a[name][i] += 1e-6
                up = loss(a)
                a[name][i] -= 2e-6
                num[i] = (up - loss(a)) / 2e-6
            np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-7, err_msg="d" + name)


@pytest.mark.parametrize("B,T", [(1, 0), (0, 9), (0, 0)])
def test_empty_batch_or_length(B, T):
    """An empty batch or sequence is a successful call with empty outputs (numpy reports zero
    strides for empty arrays; the call must not take them for bad ones)."""
    q = np.zeros((B, T, 4, 16), np.float32)
    k = np.zeros((B, T, 2, 16), np.float32)
    g = np.zeros((B, T, 4), np.float32)
    cfg = nsa.Config(8, 4, 8, 2, 1, 1, 8)
    res = nsa.forward(q, k, k, g, g, g, config=cfg)
    assert res.o.shape == (B, T, 4, 16)
    grads = res.backward(np.zeros_like(res.o))
    assert grads.q.shape == q.shape and grads.k.shape == k.shape and grads.g_cmp.shape == g.shape
    att = nsa.attention(q, k, k, causal=True)
    assert att.o.shape == (B, T, 4, 16) and att.lse.shape == (B, T, 4)
    agrads = att.backward(np.zeros_like(att.o))
    assert agrads.dq.shape == q.shape and agrads.dv.shape == k.shape
    assert nsa.compress(k, config=cfg).shape[:2] == (B, 0 if T < 8 else (T - 8) // 4 + 1)
