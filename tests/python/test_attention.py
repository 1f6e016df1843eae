"""nsa.attention (the flash-attention core) from Python, numpy on the CPU backend, against a
float64 reference that materialises the score matrix (written here from nsa.h's definitions)."""
import numpy as np
import pytest

import nsa


def ref_attention(q, k, v, dout, *, causal=False, window=(-1, -1), softcap=0.0, sinks=None, qseg=None, kseg=None,
                  bias=None, mask=None):
    """float64 forward and backward: o, lse, dq, dk, dv, dsinks, dbias (full, before broadcast sums)."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    B, Tq, HQ, DK = q.shape
    _, Tk, H, DV = v.shape
    G = HQ // H
    scale = 1.0 / np.sqrt(DK)
    ke, ve = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)          # [B, Tk, HQ, D]
    raw = scale * np.einsum("bihd,bjhd->bhij", q, ke)                   # [B, HQ, Tq, Tk]
    s = softcap * np.tanh(raw / softcap) if softcap > 0 else raw.copy()
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    i = np.arange(Tq)[:, None] + (Tk - Tq)                              # bottom-right aligned diagonal
    j = np.arange(Tk)[None, :]
    vis = np.ones((Tq, Tk), bool)
    wl, wr = window
    if causal:
        wr = 0
    if wl >= 0:
        vis &= j >= i - wl
    if wr >= 0:
        vis &= j <= i + wr
    vis = np.broadcast_to(vis, (B, HQ, Tq, Tk)).copy()
    if qseg is not None:
        vis &= (np.asarray(qseg)[:, None, :, None] == np.asarray(kseg)[:, None, None, :])
    if mask is not None:
        vis &= np.broadcast_to(np.asarray(mask) != 0, vis.shape)
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, np.asarray(sinks, np.float64)[None, :, None, None])
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    den = e.sum(-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(np.asarray(sinks, np.float64)[None, :, None, None] - m)
    with np.errstate(divide="ignore"):
        lse = np.where(den > 0, np.log(den) + m, -np.inf)[..., 0]
    P = np.where(den > 0, e / np.where(den > 0, den, 1), 0.0)
    o = np.einsum("bhij,bjhd->bihd", P, ve)
    do = dout
    dve = np.einsum("bhij,bihd->bjhd", P, do)
    dP = np.einsum("bihd,bjhd->bhij", do, ve)
    D = np.einsum("bihd,bihd->bhi", do, o)[..., None]
    dS = P * (dP - D)
    dsinks = None
    if sinks is not None:
        psink = np.exp(np.asarray(sinks, np.float64)[None, :, None] - lse)
        dsinks = -(psink * D[..., 0]).sum(axis=(0, 2))
    draw = dS * (1 - np.tanh(raw / softcap) ** 2) if softcap > 0 else dS
    dq = scale * np.einsum("bhij,bjhd->bihd", draw, ke)
    dke = scale * np.einsum("bhij,bihd->bjhd", draw, q)
    dk = dke.reshape(B, Tk, H, G, DK).sum(3)
    dv = dve.reshape(B, Tk, H, G, DV).sum(3)
    return o, np.transpose(lse, (0, 2, 1)), dq, dk, dv, dsinks, dS


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, Tq=5, Tk=9),
    dict(causal=True, Tq=9, Tk=5),
    dict(window=(3, 1)),
    dict(softcap=2.0, causal=True),
    dict(sinks=True),
    dict(sinks=True, causal=True, Tq=4, Tk=7),
    dict(segments=True),
    dict(bias=True, causal=True),
    dict(mask=True),
    dict(softcap=3.0, sinks=True, bias=True, segments=True, mask=True, window=(4, 2)),
]


@pytest.mark.parametrize("case", CASES, ids=[",".join(sorted(c)) or "plain" for c in CASES])
def test_attention_matches_reference(case):
    rng = np.random.default_rng(7)
    B, HQ, H, DK, DV = 2, 4, 2, 16, 8
    Tq, Tk = case.get("Tq", 7), case.get("Tk", 7)
    q, k, v = rand(rng, B, Tq, HQ, DK), rand(rng, B, Tk, H, DK), rand(rng, B, Tk, H, DV)
    dout = rand(rng, B, Tq, HQ, DV)
    kw, rk = {}, {}
    if case.get("causal"):
        kw["causal"] = rk["causal"] = True
    if "window" in case:
        kw["window"] = rk["window"] = case["window"]
    if case.get("softcap"):
        kw["softcap"] = rk["softcap"] = case["softcap"]
    if case.get("sinks"):
        kw["sinks"] = rk["sinks"] = rand(rng, HQ)
    if case.get("segments"):
        qs = np.sort(rng.integers(0, 2, (B, Tq))).astype(np.int32)
        ks = np.sort(rng.integers(0, 2, (B, Tk))).astype(np.int32)
        kw.update(q_segment_ids=qs, k_segment_ids=ks)
        rk.update(qseg=qs, kseg=ks)
    if case.get("bias"):
        kw["bias"] = rk["bias"] = rand(rng, 1, HQ, Tq, Tk)
    if case.get("mask"):
        kw["mask"] = rk["mask"] = rng.random((B, 1, Tq, Tk)) < 0.8
    r = nsa.attention(q, k, v, **kw)
    g = r.backward(dout, dbias=bool(case.get("bias")))
    o, lse, dq, dk, dv, dsinks, dS = ref_attention(q, k, v, dout, **rk)
    tol = dict(rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(r.o, o, **tol)
    np.testing.assert_allclose(r.lse, lse, **tol)
    np.testing.assert_allclose(g.dq, dq, **tol)
    np.testing.assert_allclose(g.dk, dk, **tol)
    np.testing.assert_allclose(g.dv, dv, **tol)
    if case.get("sinks"):
        np.testing.assert_allclose(g.dsinks, dsinks, **tol)
    else:
        assert g.dsinks is None
    if case.get("bias"):
        np.testing.assert_allclose(g.dbias, dS.sum(axis=0, keepdims=True), **tol)  # bias broadcast over B


def test_rows_without_keys_give_zero_and_sink_lse():
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, 1, 3, 2, 8), rand(rng, 1, 3, 1, 8), rand(rng, 1, 3, 1, 8)
    mask = np.zeros((1, 1, 3, 3), bool)
    mask[0, 0, 2, :] = True
    sinks = np.array([0.5, -1.0], np.float32)
    r = nsa.attention(q, k, v, mask=mask, sinks=sinks)
    assert np.all(r.o[0, :2] == 0) and np.all(np.isfinite(r.o))
    np.testing.assert_allclose(r.lse[0, :2], np.broadcast_to(sinks, (2, 2)), rtol=1e-6)
    r2 = nsa.attention(q, k, v, mask=mask)
    assert np.all(r2.lse[0, :2] == -np.inf) and np.all(r2.o[0, :2] == 0)


def test_dropout_is_reproducible_and_changes_the_output():
    rng = np.random.default_rng(5)
    q, k, v = rand(rng, 1, 16, 2, 8), rand(rng, 1, 16, 2, 8), rand(rng, 1, 16, 2, 8)
    a = nsa.attention(q, k, v, causal=True, dropout_p=0.3, seed=11, offset=0)
    b = nsa.attention(q, k, v, causal=True, dropout_p=0.3, seed=11, offset=0)
    c = nsa.attention(q, k, v, causal=True, dropout_p=0.3, seed=12, offset=0)
    plain = nsa.attention(q, k, v, causal=True)
    assert np.array_equal(a.o, b.o)
    assert not np.array_equal(a.o, c.o) and not np.array_equal(a.o, plain.o)
    np.testing.assert_array_equal(a.lse, plain.lse)  # lse of the undropped softmax
    ga, gb = a.backward(np.ones_like(a.o)), b.backward(np.ones_like(b.o))
    assert np.array_equal(ga.dq, gb.dq) and np.array_equal(ga.dv, gb.dv)


def test_bad_options_raise_the_specific_status():
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, 1, 4, 2, 8), rand(rng, 1, 4, 1, 8), rand(rng, 1, 4, 1, 8)
    with pytest.raises(nsa.NsaError) as e:
        nsa.attention(q, k, v, softcap=-1.0)
    assert nsa.status_name(e.value.status) == "BAD_SOFTCAP"
    assert str(e.value) == "nsa_attention: softcap: -1, must be finite and >= 0 (0 = off) (NSA_STATUS_BAD_SOFTCAP)"
    with pytest.raises(nsa.NsaError) as e:
        nsa.attention(q, k, v, dropout_p=1.0)
    assert nsa.status_name(e.value.status) == "BAD_DROPOUT"
    out = np.full((1, 4, 2, 8), 7.0, np.float32)
    with pytest.raises(nsa.NsaError) as e:
        nsa.attention(q, k, v, sinks=np.zeros(3, np.float32), out=out)  # sinks must be [HQ]
    assert e.value.detail == "sinks: dim 0 (HQ) is 3, q has 2"
    assert np.all(out == 7.0)  # untouched on error


def test_torch_tensors_match_numpy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, 1, 6, 4, 16), rand(rng, 1, 6, 2, 16), rand(rng, 1, 6, 2, 16)
    mask = rng.random((1, 1, 6, 6)) < 0.7
    want = nsa.attention(q, k, v, causal=True, softcap=5.0, mask=mask)
    got = nsa.attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), causal=True, softcap=5.0,
                        mask=torch.from_numpy(mask))
    np.testing.assert_array_equal(got.o.numpy(), want.o)
    np.testing.assert_array_equal(got.lse.numpy(), want.lse)
    if torch.cuda.is_available():  # CUDA, bf16
        dev = torch.device("cuda")
        qc, kc, vc = (torch.from_numpy(x).to(dev, torch.bfloat16) for x in (q, k, v))
        r = nsa.attention(qc, kc, vc, causal=True, window=(3, 0))
        o, lse = ref_attention(qc.float().cpu().numpy(), kc.float().cpu().numpy(), vc.float().cpu().numpy(),
                               np.zeros((1, 6, 4, 16), np.float32), causal=True, window=(3, 0))[:2]
        np.testing.assert_allclose(r.o.float().cpu().numpy(), o, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(r.lse.cpu().numpy(), lse, rtol=1e-3, atol=1e-3)
        # every option runs on CUDA too: the CPU backend on the same bf16-rounded inputs
        maskc = torch.from_numpy(mask).to(dev)
        r = nsa.attention(qc, kc, vc, causal=True, softcap=5.0, mask=maskc)
        want = nsa.attention(qc.float().cpu().numpy(), kc.float().cpu().numpy(), vc.float().cpu().numpy(), causal=True,
                             softcap=5.0, mask=mask)
        np.testing.assert_allclose(r.o.float().cpu().numpy(), want.o, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(r.lse.cpu().numpy(), want.lse, rtol=1e-3, atol=1e-3)


def test_torch_autograd_matches_reference():
    """nsa.attention records autograd on torch tensors: loss.backward() gives the float64
    reference's dq, dk, dv, dsinks and (broadcast-summed) dbias; lse carries no gradient."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    B, Tq, Tk, HQ, H, DK, DV = 2, 6, 9, 4, 2, 16, 8
    q, k, v = rand(rng, B, Tq, HQ, DK), rand(rng, B, Tk, H, DK), rand(rng, B, Tk, H, DV)
    sinks, bias = rand(rng, HQ), rand(rng, 1, HQ, Tq, Tk)
    mask = rng.random((B, 1, Tq, Tk)) < 0.8
    w = rand(rng, B, Tq, HQ, DV)
    tq, tk, tv, ts, tb = (torch.tensor(x, requires_grad=True) for x in (q, k, v, sinks, bias))
    r = nsa.attention(tq, tk, tv, causal=True, softcap=4.0, sinks=ts, bias=tb, mask=torch.from_numpy(mask))
    assert r.o.requires_grad and not r.lse.requires_grad
    (r.o * torch.from_numpy(w)).sum().backward()
    o, lse, dq, dk, dv, dsinks, dS = ref_attention(q, k, v, w, causal=True, softcap=4.0, sinks=sinks, bias=bias,
                                                   mask=mask)
    tol = dict(rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(r.o.detach().numpy(), o, **tol)
    np.testing.assert_allclose(tq.grad.numpy(), dq, **tol)
    np.testing.assert_allclose(tk.grad.numpy(), dk, **tol)
    np.testing.assert_allclose(tv.grad.numpy(), dv, **tol)
    np.testing.assert_allclose(ts.grad.numpy(), dsinks, **tol)
    np.testing.assert_allclose(tb.grad.numpy(), dS.sum(axis=0, keepdims=True), **tol)
    # without requires_grad (or under no_grad) nothing is recorded
    with torch.no_grad():
        assert nsa.attention(tq, tk, tv, causal=True).o.grad_fn is None


def test_torch_compile_fullgraph_matches_eager():
    """nsa.attention is the custom op torch.ops.nsa.attention: torch.compile(fullgraph=True)
    traces it (fake implementations give the shapes) and gives eager's output and gradients."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch.library, "custom_op"):
        pytest.skip("torch < 2.4: nsa.attention is an autograd.Function (eager only)")
    torch.manual_seed(0)
    leaves = [torch.randn(1, 40, 4, 16), torch.randn(1, 40, 2, 16), torch.randn(1, 40, 2, 16), torch.randn(4),
              torch.randn(1, 4, 40, 40)]
    for x in leaves:
        x.requires_grad_(True)

    def f(q, k, v, s, b):
        return nsa.attention(q, k, v, causal=True, softcap=3.0, sinks=s, bias=b).o

    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        for x in leaves:
            x.grad = None
        out = fn(*leaves)
        out.square().sum().backward()
        grads.append([out.detach()] + [x.grad.clone() for x in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_torch_attention_ops_pass_opcheck():
    """torch.library.opcheck on both ops (schema, fake tensors, autograd registration, AOT)."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch.library, "custom_op"):
        pytest.skip("torch < 2.4: no custom ops")
    q, k, v = torch.randn(1, 24, 4, 16), torch.randn(1, 24, 2, 16), torch.randn(1, 24, 2, 16)
    s, b = torch.randn(4), torch.randn(1, 4, 24, 24)
    sc = (True, -1, -1, 0.0, 2.0, 0.0, 0, 0)
    none6 = (None,) * 6
    for x in (q, k, v, s, b):
        x.requires_grad_(True)
    for args in ((q, k, v, s, b) + none6 + sc, (q, k, v, None, None) + none6 + sc):
        torch.library.opcheck(torch.ops.nsa.attention.default, args)
    d = [x.detach() for x in (q, k, v, s, b)]
    o, lse = torch.ops.nsa.attention(*d, *none6, *sc)
    torch.library.opcheck(torch.ops.nsa.attention_bwd.default,
                          (torch.randn_like(o), d[0], d[1], d[2], o, lse, d[3], d[4]) + none6 + sc + (True,))


def test_torch_autograd_is_the_numpy_computation_with_dropout_and_varlen():
    """Through the custom ops, the torch path (cu_seqlens as a list, dropout seed / offset)
    gives bitwise the numpy path's output and gradients: same mask, same packing."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, 1, 20, 4, 16), rand(rng, 1, 20, 2, 16), rand(rng, 1, 20, 2, 16)
    kw = dict(causal=True, dropout_p=0.2, seed=3, offset=8, cu_seqlens=[0, 7, 20])
    a = nsa.attention(q, k, v, **kw)
    ga = a.backward(np.ones_like(a.o))
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    b = nsa.attention(tq, tk, tv, **kw)
    b.o.sum().backward()
    np.testing.assert_array_equal(b.o.detach().numpy(), a.o)
    for got, want in ((tq.grad, ga.dq), (tk.grad, ga.dk), (tv.grad, ga.dv)):
        np.testing.assert_array_equal(got.numpy(), want)
