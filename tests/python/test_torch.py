"""torch tensors on the CPU and on CUDA: autograd through torch.ops.nsa against the naive torch
implementation of nsa_ref.py (float64 reference, same-precision naive for the tolerance
rule), the fla-compatible call, custom-op checks, torch.compile(fullgraph=True), autocast,
CUDA streams and bad input. Skips without torch; CUDA cases skip without a GPU."""
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import nsa  # noqa: E402
import nsa_ref as ref  # noqa: E402
from conftest import devices  # noqa: E402
from helpers import check_close, rand_inputs, selection_agrees  # noqa: E402

DEVICES = devices()
NEEDS_CUSTOM_OP = pytest.mark.skipif(not hasattr(torch.library, "custom_op"),
                                     reason="torch < 2.4: no torch.library.custom_op")
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 4e-3, torch.float16: 1e-3}


def storage_dtypes(device):
    """The CUDA backend takes half precision only; the CPU one every float dtype."""
    return [torch.float32, torch.bfloat16] if device == "cpu" else [torch.bfloat16, torch.float16]


def to_torch(x, device, dtype, grad=True):
    out = {}
    for n, a in x.items():
        if a is None:
            out[n] = None
            continue
        t = torch.as_tensor(a).to(device=device, dtype=dtype)
        out[n] = t.requires_grad_(grad)
    return out


def leaf(t, dtype):
    return None if t is None else t.detach().to(dtype).requires_grad_(True)


def run_naive(x, dtype, cfg, sel, counts=None, cu=None, k_cmp=None, v_cmp=None, dout=None):
    """Naive torch forward + autograd backward in `dtype` (inputs: the library's storage values)."""
    t = {n: leaf(a, dtype) for n, a in x.items()}
    kc, vc = leaf(k_cmp, dtype), leaf(v_cmp, dtype)
    o = ref.torch_nsa(t["q"], t["k"], t["v"], t["g_cmp"], t["g_slc"], t["g_swa"], cfg, sel, counts, kc, vc, cu)
    o.backward(dout.to(dtype))
    grads = {n: a.grad for n, a in t.items() if a is not None}
    if kc is not None:
        grads.update(k_cmp=kc.grad, v_cmp=vc.grad)
    return o.detach(), grads


def np64(t):
    return t.detach().to(torch.float64).cpu().numpy()


CASES = [
    # (id, B, T, HQ, H, DK, DV, config, gates, cu_seqlens, caller k_cmp)
    ("small-paper", 2, 100, 4, 2, 16, 16, nsa.Config(16, 8, 32, 4, 1, 2, 24), ("cmp", "slc", "swa"), None, False),
    ("G8-d64", 1, 200, 8, 1, 64, 64, nsa.Config(32, 16, 64, 3, 1, 2, 40), ("cmp", "slc", "swa"), None, False),
    ("varlen", 1, 150, 4, 2, 64, 64, nsa.Config(16, 8, 16, 4, 1, 2, 20), ("cmp", "slc", "swa"),
     [0, 0, 1, 70, 70, 150], False),
    ("phi", 1, 96, 4, 2, 64, 64, nsa.Config(16, 8, 16, 4, 1, 2, 20), ("cmp", "slc", "swa"), None, True),
    ("slc-swa", 1, 80, 2, 2, 64, 64, nsa.Config(16, 8, 16, 3, 1, 2, 12), ("slc", "swa"), None, False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_autograd_vs_naive(device, case):
    name, B, T, HQ, H, DK, DV, config, gates, cu, phi = case
    for dtype in storage_dtypes(device):
        seed = abs(hash(name)) % 1000
        x = to_torch(rand_inputs(seed, B, T, HQ, H, DK, DV, gates=gates), device, dtype)
        k_cmp = v_cmp = None
        if phi:
            nc = nsa.Config.num_cmp_blocks(config, T)
            g = torch.Generator().manual_seed(seed)
            k_cmp = torch.randn(B, nc, H, DK, generator=g).to(device, dtype).requires_grad_(True)
            v_cmp = torch.randn(B, nc, H, DV, generator=g).to(device, dtype).requires_grad_(True)
        o, aux = nsa.native_sparse_attention(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"],
                                             config=config, k_cmp=k_cmp, v_cmp=v_cmp, cu_seqlens=cu, return_aux=True)
        assert o.dtype == dtype and o.device.type == device and o.shape == (B, T, HQ, DV)
        dout = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
        o.backward(dout)
        cfg = ref.Cfg.of(config)
        sel = aux.block_indices
        if "slc" in gates:
            assert sel.dtype == torch.int32 and sel.shape == (B, T, H, config.slc_topk)
        o64, g64 = run_naive(x, torch.float64, cfg, sel, cu=cu, k_cmp=k_cmp, v_cmp=v_cmp, dout=dout)
        olp, glp = run_naive(x, dtype, cfg, sel, cu=cu, k_cmp=k_cmp, v_cmp=v_cmp, dout=dout)
        tag = "%s/%s" % (device, dtype)
        check_close(tag + " o", np64(o), np64(o64), np64(olp), floor=FLOOR[dtype], seed=seed)
        inputs = dict(x, k_cmp=k_cmp, v_cmp=v_cmp)
        for n, want in g64.items():
            got = inputs[n].grad
            assert got is not None and got.dtype == dtype, n
            check_close(tag + " d" + n, np64(got), np64(want), np64(glp[n]), floor=FLOOR[dtype], seed=seed)


@pytest.mark.parametrize("device", DEVICES)
def test_selection_vs_reference(device):
    B, T, HQ, H, D = 1, 256, 16, 2, 64
    config = nsa.Config(32, 16, 32, 5, 1, 2, 64)
    for dtype in storage_dtypes(device):
        x = to_torch(rand_inputs(7, B, T, HQ, H, D, D), device, dtype, grad=False)
        _, aux = nsa.native_sparse_attention(x["q"], x["k"], x["v"], None, x["g_slc"], None, config=config,
                                             return_aux=True)
        xs = {n: (np64(t) if t is not None else None) for n, t in x.items()}
        r = ref.nsa(xs["q"], xs["k"], xs["v"], None, xs["g_slc"], None, ref.Cfg.of(config))
        tol = 1e-4 if dtype == torch.float32 else 0.02 * HQ // H
        selection_agrees(aux.block_indices[0].cpu().numpy(), r["block_indices"][0],
                         lambda t, h: r["importance"][0][h, t], None, tol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_parallel_nsa_vs_naive(device):
    """fla's call: g_slc None = gate 1, window iff window_size > 0, int64 indices and an int64
    cu_seqlens on the device as fla users pass them."""
    B, T, HQ, H, D, bs = 1, 160, 16, 1, 64, 16
    for dtype in storage_dtypes(device):
        x = to_torch(rand_inputs(17, B, T, HQ, H, D, D), device, dtype)
        cu = torch.tensor([0, 50, 51, 160], dtype=torch.long, device=device)
        o = nsa.parallel_nsa(x["q"], x["k"], x["v"], x["g_cmp"], None, x["g_swa"], block_counts=4, block_size=bs,
                             window_size=32, cu_seqlens=cu)
        cfg = nsa.Config.fla(bs, 4, 32)
        ones = torch.ones_like(x["g_cmp"]).requires_grad_(True)
        o2, aux = nsa.native_sparse_attention(x["q"], x["k"], x["v"], x["g_cmp"], ones, x["g_swa"], config=cfg,
                                              cu_seqlens=cu, return_aux=True)
        torch.testing.assert_close(o, o2, rtol=0, atol=0)
        dout = torch.randn(o.shape, generator=torch.Generator().manual_seed(3)).to(device, dtype)
        o.backward(dout)
        xr = dict(x, g_slc=ones)
        o64, g64 = run_naive(xr, torch.float64, ref.Cfg.of(cfg), aux.block_indices, cu=cu.tolist(), dout=dout)
        olp, glp = run_naive(xr, dtype, ref.Cfg.of(cfg), aux.block_indices, cu=cu.tolist(), dout=dout)
        check_close("o", np64(o), np64(o64), np64(olp), floor=FLOOR[dtype])
        for n in ("q", "k", "v", "g_cmp", "g_swa"):
            check_close("d" + n, np64(x[n].grad), np64(g64[n]), np64(glp[n]), floor=FLOOR[dtype])
        # caller indices (int64, as fla's LongTensor) and per-row counts; no compressed branch
        g = torch.Generator().manual_seed(5)
        idx = torch.randint(-1, T // bs, (B, T, H, 6), generator=g).to(device)
        counts = torch.randint(0, 7, (B, T, H), generator=g).to(device)
        o = nsa.parallel_nsa(x["q"], x["k"], x["v"], None, x["g_slc"], None, block_indices=idx, block_counts=counts,
                             block_size=bs)
        xr = dict(x, g_cmp=None, g_swa=None)
        o64, _ = run_naive(xr, torch.float64, ref.Cfg.of(cfg), idx, counts, dout=dout)
        olp, _ = run_naive(xr, dtype, ref.Cfg.of(cfg), idx, counts, dout=dout)
        check_close("o (caller indices)", np64(o), np64(o64), np64(olp), floor=FLOOR[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_raw_calls_match_autograd(device):
    """nsa.forward(...).backward(dout) on tensors equals the autograd path bit for bit."""
    dtype = storage_dtypes(device)[0]
    cfg = nsa.Config(16, 8, 16, 3, 1, 2, 16)
    x = to_torch(rand_inputs(23, 1, 64, 4, 2, 64, 64), device, dtype)
    o = nsa.native_sparse_attention(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg)
    dout = torch.ones_like(o)
    o.backward(dout)
    with torch.no_grad():
        res = nsa.forward(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg)
        grads = res.backward(dout)
    assert torch.equal(res.o, o.detach())
    for n in ("q", "k", "v", "g_cmp", "g_slc", "g_swa"):
        assert torch.equal(getattr(grads, n), x[n].grad), n


@NEEDS_CUSTOM_OP
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    """torch.library.opcheck: schema, fake (meta) implementation, autograd registration,
    AOT dispatch, for the forward op (with and without caller tensors) and the backward op."""
    dtype = storage_dtypes(device)[0]
    x = to_torch(rand_inputs(29, 1, 48, 4, 2, 64, 64), device, dtype)
    cfg = (16, 8, 16, 3, 1, 2, 16, 0.0, 0.3)  # ends with scale and the window branch's own scale
    cu = [0, 20, 48]
    nc = nsa.cmp_offsets(nsa.Config(*cfg), cu)[-1]  # packed compressed rows of the two sequences
    kc = torch.randn(1, nc, 2, 64, device=device, dtype=dtype, requires_grad=True)
    vc = torch.randn(1, nc, 2, 64, device=device, dtype=dtype, requires_grad=True)
    args = (x["q"], x["k"], x["v"], None, None, None, None, None, None, x["g_cmp"], x["g_slc"], x["g_swa"],
            None, None, None) + cfg
    torch.library.opcheck(torch.ops.nsa.forward.default, args)
    args = (x["q"], x["k"], x["v"], kc, vc, None, None, None, None, x["g_cmp"], None, x["g_swa"],
            None, None, torch.tensor(cu, dtype=torch.int32)) + cfg
    torch.library.opcheck(torch.ops.nsa.forward.default, args)
    with torch.no_grad():
        out = torch.ops.nsa.forward(*args)
    dout = torch.randn_like(out[0])
    # the backward op has no autograd of its own (no double backward): checked on plain tensors
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args[:15])
    bargs = (dout,) + plain + tuple(out[1:]) + cfg
    torch.library.opcheck(torch.ops.nsa.backward.default, bargs)


def _compile_backend(device):
    return "inductor" if device == "cuda" else "aot_eager"


@NEEDS_CUSTOM_OP
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    dtype = storage_dtypes(device)[-1]
    cfg = nsa.Config(16, 8, 16, 3, 1, 2, 16)
    x = to_torch(rand_inputs(31, 2, 64, 4, 2, 64, 64), device, dtype)
    w = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)

    def fn(q, k, v, g1, g2, g3, w):
        o = nsa.native_sparse_attention(q @ w, k, v, g1, g2, g3, config=cfg)
        o2 = nsa.parallel_nsa(q, k, v, g1, None, g3, block_counts=3, block_size=16, window_size=16)
        return (o.float().square().mean() + o2.float().mean()), o

    args = (x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], w)
    torch._dynamo.reset()
    cfn = torch.compile(fn, fullgraph=True, backend=_compile_backend(device))
    loss_c, o_c = cfn(*args)
    grads_c = torch.autograd.grad(loss_c, args)
    loss_e, o_e = fn(*args)
    grads_e = torch.autograd.grad(loss_e, args)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(o_c, o_e, **tol)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_bf16(device):
    """float32 inputs under autocast(bf16): the op runs in bf16, the output is bf16, gradients
    come back in float32, and stay close to a bf16-input run."""
    cfg = nsa.Config(16, 8, 16, 3, 1, 2, 16)
    x = to_torch(rand_inputs(37, 1, 80, 4, 2, 64, 64), device, torch.float32)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        o = nsa.native_sparse_attention(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg)
        o2 = nsa.parallel_nsa(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], block_counts=3,
                              block_size=16, window_size=16)
    assert o.dtype == torch.bfloat16 and o2.dtype == torch.bfloat16
    (o.float().sum() + o2.float().sum()).backward()
    for n in ("q", "k", "v", "g_cmp", "g_slc", "g_swa"):
        g = x[n].grad
        assert g is not None and g.dtype == torch.float32 and torch.isfinite(g).all(), n
    xb = to_torch({n: np64(t) for n, t in x.items()}, device, torch.bfloat16)
    ob = nsa.native_sparse_attention(xb["q"], xb["k"], xb["v"], xb["g_cmp"], xb["g_slc"], xb["g_swa"], config=cfg)
    torch.testing.assert_close(o, ob, rtol=0, atol=0)
    if hasattr(torch.library, "custom_op"):
        # compiled, with autocast entered inside the compiled region and around it
        def f_inside(q, k, v, g1, g2, g3):
            with torch.autocast(device_type=device, dtype=torch.bfloat16):
                return nsa.native_sparse_attention(q, k, v, g1, g2, g3, config=cfg)

        def f_plain(q, k, v, g1, g2, g3):
            return nsa.native_sparse_attention(q, k, v, g1, g2, g3, config=cfg)

        args = (x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"])
        torch._dynamo.reset()
        oc = torch.compile(f_inside, fullgraph=True, backend=_compile_backend(device))(*args)
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            oc2 = torch.compile(f_plain, fullgraph=True, backend=_compile_backend(device))(*args)
        for out in (oc, oc2):
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out, ob, rtol=0, atol=0)
        (oc.float().sum() + oc2.float().sum()).backward()


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_and_inference(device):
    dtype = storage_dtypes(device)[0]
    cfg = nsa.Config(16, 8, 16, 3, 1, 2, 16)
    x = to_torch(rand_inputs(41, 1, 40, 4, 2, 64, 64), device, dtype, grad=False)
    with torch.inference_mode():
        o = nsa.native_sparse_attention(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg)
    assert not o.requires_grad and torch.isfinite(o.float()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    dtype = storage_dtypes(device)[0]
    cfg = nsa.Config(16, 8, 16, 3, 1, 2, 16)
    x = to_torch(rand_inputs(43, 1, 40, 4, 2, 64, 64), device, dtype, grad=False)
    q, k, v, g = x["q"], x["k"], x["v"], x["g_cmp"]

    def raises(status, *args, **kw):
        with pytest.raises(nsa.NsaError) as e:
            nsa.native_sparse_attention(*args, **kw)
        assert e.value.name == status, str(e.value)
        assert e.value.detail and e.value.detail in str(e.value)

    raises("BAD_DTYPE", q, k.to(torch.float16 if dtype != torch.float16 else torch.bfloat16), v, g, g, g, config=cfg)
    raises("BAD_DTYPE", q.double(), k.double(), v.double(), g, g, g, config=cfg)
    raises("BAD_GQA", q, k[:, :, :1].expand(1, 40, 3, 64), v[:, :, :1].expand(1, 40, 3, 64), g, g, g, config=cfg)
    raises("BAD_RANK", q[0], k, v, g, g, g, config=cfg)
    raises("BAD_TOPK", q, k, v, g, g, g, config=nsa.Config(16, 8, 16, 2, 1, 2, 16))
    raises("BAD_CU_SEQLENS", q, k, v, g, g, g, config=cfg, cu_seqlens=[0, 41])
    raises("BAD_ARGUMENT", q, k, v, None, None, None, config=cfg)
    raises("BAD_SHAPE", q, k, v, g[:, :-1], g, g, config=cfg)
    if device == "cuda":
        raises("BAD_ARGUMENT", q, k.cpu(), v, g, g, g, config=cfg)  # never hands a host pointer to a kernel
    # an output the caller owns is left untouched on error
    out = torch.full((1, 40, 4, 64), 7.25, dtype=dtype, device=device)
    with pytest.raises(nsa.NsaError):
        nsa.forward(q, k, v[..., :32].contiguous(), g, g, g, config=cfg, out=out)
    with pytest.raises(nsa.NsaError):
        nsa.forward(q, k, v, g[:, :-1], g, g, config=cfg, out=out)
    assert (out == 7.25).all()


@pytest.mark.skipif(not (torch.cuda.is_available() and nsa.backend_available("cuda")),
                    reason="needs a CUDA device and libnsa with the CUDA backend")
def test_cuda_current_stream():
    cfg = nsa.Config(16, 8, 16, 3, 1, 2, 16)
    x = to_torch(rand_inputs(47, 1, 128, 4, 2, 64, 64), "cuda", torch.bfloat16, grad=False)
    o0 = nsa.native_sparse_attention(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        o1 = nsa.native_sparse_attention(x["q"], x["k"], x["v"], x["g_cmp"], x["g_slc"], x["g_swa"], config=cfg)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(o0, o1)
    from nsa import _core, _lib
    assert (_lib.BACKEND_CUDA, torch.cuda.current_device(), s.cuda_stream) in _core._contexts
