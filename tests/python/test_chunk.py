"""Query chunks (nsa.h "Query chunks") through the torch front end: q, the gates and dout of
positions [s, T) against k, v of [0, T) must give the whole call's rows, selection and
gradients (with dout zero before s). On the CPU (float32) bit for bit where the arithmetic is
the same; on CUDA, whose whole-sequence calls the sweep checks against the float64 reference,
within the rounding of the storage dtype: fixed cases and random ones over configurations,
group sizes, head dims, the caller's compression, selection and branch K / V."""
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import nsa  # noqa: E402
from conftest import devices  # noqa: E402

CONFIG = dict(cmp_len=8, cmp_stride=4, slc_block=16, slc_topk=4, n_init=1, n_local=2, window=24)


CHUNK_CASES = {  # device -> [(dtype name, B, T, HQ, H, D, s)]
    "cpu": [("float32", 2, 171, 4, 2, 16, 70)],
    "cuda": [("bfloat16", 2, 1500, 16, 2, 64, 603), ("float16", 1, 2100, 8, 2, 128, 1999),
             ("bfloat16", 1, 700, 4, 4, 64, 0), ("float32", 1, 300, 4, 2, 32, 77)],  # f32: the scalar kernels
}


@pytest.mark.parametrize("device", devices())
def test_query_chunk_rows_and_gradients(device):
    for case in CHUNK_CASES[device if isinstance(device, str) else "cuda"]:
        _query_chunk_case(device, *case)


def _query_chunk_case(device, dtype_name, B, T, HQ, H, D, s):
    """The building block on its own: q (and the gates) of positions [s, T) against k, v of [0, T)
    give the whole call's rows, and with dout zero before s the same gradients (torch autograd),
    the selection too (nsa.select with kv_len). The CPU in float32: the same rows bit for bit;
    CUDA in bfloat16 (the whole call is checked against the float64 reference by the sweep):
    the same selection, rows and gradients within bf16 rounding of different summation orders."""
    gen = torch.Generator().manual_seed(5)
    cuda = device == "cuda"
    dtype = getattr(torch, dtype_name)
    exact = dtype == torch.float32
    cfg = nsa.Config(**CONFIG)

    def leaf(x):
        return x.to(device=device, dtype=dtype).requires_grad_(True)

    q, k, v = (leaf(torch.randn(B, T, n, D, generator=gen)) for n in (HQ, H, H))
    g = [leaf(torch.rand(B, T, HQ, generator=gen)) for _ in range(3)]
    dout = torch.randn(B, T, HQ, D, generator=gen).to(device=device, dtype=dtype)
    dout[:, :s] = 0
    o, aux = nsa.native_sparse_attention(q, k, v, *g, config=cfg, return_aux=True)
    (o.float() * dout.float()).sum().backward()
    whole = [x.grad.clone() for x in [q, k, v] + g]
    for x in [q, k, v] + g:
        x.grad = None
    o2, aux2 = nsa.native_sparse_attention(q[:, s:], k, v, *[x[:, s:] for x in g], config=cfg, return_aux=True)
    (o2.float() * dout[:, s:].float()).sum().backward()
    assert torch.equal(aux2.block_indices, aux.block_indices[:, s:])

    def close(got, want):
        if exact:
            return torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        err = (got.float() - want.float()).abs().max().item()
        return err <= 2e-2 * want.float().abs().max().item() + 1e-3

    if cuda or not exact:
        assert close(o2, o[:, s:].detach())
    else:
        assert torch.equal(o2, o[:, s:].detach())
    names = ["q", "k", "v", "g_cmp", "g_slc", "g_swa"]
    for name, got, want in zip(names, [x.grad for x in [q, k, v] + g], whole):
        assert close(got, want), (name, dtype_name, T, s)
    k_cmp = nsa.compress(k.detach(), cfg)
    assert torch.equal(nsa.select(q.detach()[:, s:], k_cmp, cfg, kv_len=T), nsa.select(q.detach(), k_cmp, cfg)[:, s:])
    with pytest.raises(nsa.NsaError, match="kv_len"):
        nsa.select(q.detach()[:, s:], k_cmp, cfg, kv_len=T - s - 1)


CUDA_OK = torch.cuda.is_available() and nsa.backend_available("cuda")


@pytest.mark.skipif(not CUDA_OK, reason="needs torch with a CUDA device and libnsa's CUDA backend")
@pytest.mark.parametrize("seed", range(12))
def test_cuda_query_chunk_random(seed):
    """Random chunks on CUDA: configurations (l, d, l', n, forced blocks, window), group sizes
    1-16, head dims 64 / 128, bf16 / f16, chunk starts anywhere (0, inside and on block
    boundaries, the last row), subsets of the gates, the caller's k_cmp / v_cmp, block_indices
    (with counts), k_slc / v_slc and k_swa / v_swa."""
    import random
    r = random.Random(seed)
    l, d, lp = r.choice([(32, 16, 64), (16, 8, 32), (32, 32, 32), (16, 16, 64)])
    n_init, n_local = r.choice([(1, 2), (0, 1), (1, 0)])
    cfg = nsa.Config(cmp_len=l, cmp_stride=d, slc_block=lp, slc_topk=n_init + n_local + r.randint(1, 12), n_init=n_init,
                     n_local=n_local, window=r.randint(16, 300))
    B, H, G, D = r.randint(1, 2), r.choice([1, 2, 4]), r.choice([1, 2, 4, 8, 16]), r.choice([64, 128])
    T = r.randint(100, 2500)
    s = r.choice([0, T - 1, (T // lp) * lp, r.randint(0, T - 1), r.randint(T // 2, T - 1)])
    dtype = r.choice([torch.bfloat16, torch.float16])
    gates = r.randint(1, 7)
    own_cmp, own_idx, sep_slc, sep_swa = (r.random() < 0.3 for _ in range(4))
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape, lo=None):
        x = torch.rand(*shape, generator=gen) if lo is not None else torch.randn(*shape, generator=gen)
        return x.to("cuda", dtype).requires_grad_(True)

    q, k, v = leaf(B, T, H * G, D), leaf(B, T, H, D), leaf(B, T, H, D)
    g = [leaf(B, T, H * G, lo=0) if gates >> i & 1 else None for i in range(3)]
    extra = {}
    if own_cmp:
        nc = cfg.num_cmp_blocks(T)
        extra["k_cmp"], extra["v_cmp"] = leaf(B, nc, H, D), leaf(B, nc, H, D)
    if sep_slc:
        extra["k_slc"], extra["v_slc"] = leaf(B, T, H, D), leaf(B, T, H, D)
    if sep_swa:
        extra["k_swa"], extra["v_swa"] = leaf(B, T, H, D), leaf(B, T, H, D)
    idx = cnt = None
    if own_idx:
        nb = (T + lp - 1) // lp
        m = r.randint(1, 6)
        idx = torch.randint(-1, nb + 1, (B, T, H, m), generator=gen, dtype=torch.int32).cuda()
        cnt = torch.randint(0, m + 1, (B, T, H), generator=gen, dtype=torch.int32).cuda()
    dout = torch.randn(B, T, H * G, D, generator=gen).to("cuda", dtype)
    dout[:, :s] = 0
    leaves = [q, k, v] + [x for x in g if x is not None] + list(extra.values())

    def call(rows):
        gs = [None if x is None else x[:, rows] for x in g]
        o, aux = nsa.native_sparse_attention(q[:, rows], k, v, *gs, config=cfg, return_aux=True,
                                             block_indices=None if idx is None else idx[:, rows],
                                             block_counts=None if cnt is None else cnt[:, rows], **extra)
        (o.float() * dout[:, rows].float()).sum().backward()
        grads = [x.grad.clone() for x in leaves]
        for x in leaves:
            x.grad = None
        return o.detach(), aux, grads

    o, aux, whole = call(slice(0, T))
    o2, aux2, part = call(slice(s, T))
    what = "seed %d: T %d s %d l %d d %d l' %d n %d w %d B %d H %d G %d D %d %s gates %d cmp %d idx %d slc %d swa %d" % (
        seed, T, s, l, d, lp, cfg.slc_topk, cfg.window, B, H, G, D, dtype, gates, own_cmp, own_idx, sep_slc, sep_swa)
    if aux.block_indices is not None:
        assert torch.equal(aux2.block_indices, aux.block_indices[:, s:]), what

    def close(got, want):
        err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        return err <= 2e-2 * (want.float().abs().max().item() if want.numel() else 0.0) + 2e-3

    assert close(o2, o[:, s:]), what
    for i, (got, want) in enumerate(zip(part, whole)):
        assert close(got, want), (i, what)


def test_parallel_nsa_dense_decoding_form_with_gradients():
    """fla's dense decoding form (q shorter than k) with autograd on: the query-chunk training
    path, so gradients flow, equal to the whole call's rows; without autograd the inference step,
    the same values; numpy takes the chunk path too."""
    import numpy as np
    gen = torch.Generator().manual_seed(11)
    B, T, HQ, H, D, s = 1, 300, 4, 1, 32, 217
    q, k, v = (torch.randn(B, T, n, D, generator=gen).requires_grad_(True) for n in (HQ, H, H))
    g = [torch.rand(B, T, HQ, generator=gen).requires_grad_(True) for _ in range(3)]
    kw = dict(block_counts=4, block_size=32, window_size=64)
    o = nsa.parallel_nsa(q, k, v, *g, **kw)
    dout = torch.randn(B, T, HQ, D, generator=gen)
    dout[:, :s] = 0
    (o * dout).sum().backward()
    whole = [x.grad.clone() for x in [q, k, v] + g]
    for x in [q, k, v] + g:
        x.grad = None
    o2 = nsa.parallel_nsa(q[:, s:], k, v, *[x[:, s:] for x in g], **kw)
    assert o2.requires_grad
    assert torch.allclose(o2, o[:, s:], rtol=1e-5, atol=1e-6)
    (o2 * dout[:, s:]).sum().backward()
    for got, want in zip([x.grad for x in [q, k, v] + g], whole):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the inference step: the same rows
        o3 = nsa.parallel_nsa(q[:, s:], k, v, *[x[:, s:] for x in g], **kw)
    assert torch.allclose(o3, o[:, s:].detach(), rtol=1e-4, atol=1e-5)
    on = nsa.parallel_nsa(*[x.detach().numpy()[:, s:] if i in (0, 3, 4, 5) else x.detach().numpy()
                            for i, x in enumerate([q, k, v] + g)], **kw)
    assert np.allclose(on, o[:, s:].detach().numpy(), rtol=1e-5, atol=1e-6)
