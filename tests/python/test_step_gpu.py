"""The GPU's inference steps on their tensor-core kernels (bf16 / f16, DK = DV in {64, 128},
up to 16 query heads per kv head) against the CPU step on the same rounded inputs: a long
prefill chunk (several launch rounds), decode steps, multi-token steps, over a varlen batch
with an empty and a one-token sequence, contiguous and shuffled paged caches. Skipped without
a CUDA device."""
import numpy as np
import pytest

import nsa
from conftest import TORCH

pytestmark = pytest.mark.skipif(TORCH is None or not TORCH.cuda.is_available() or not nsa.backend_available("cuda"),
                                reason="needs torch with a CUDA device and libnsa's CUDA backend")

CFG = nsa.Config(32, 16, 64, 16, 1, 2, 512)
# the step sizes: a prefill chunk, decode, a multi-token step, another chunk, decode
STEPS = (1200, 1, 1, 5, 300, 1, 7, 1)


def _round(x, dtype):
    return TORCH.from_numpy(x).to(dtype).float().numpy()


def _caches(rng, Bn, cap, Hk, D, page, ncap):
    """(cpu caches, their block tables) as numpy float32: contiguous, or shuffled pages."""
    if page is None:
        return [np.zeros((Bn, cap, Hk, D), np.float32) for _ in range(2)], \
            [np.zeros((Bn, ncap, Hk, D), np.float32) for _ in range(2)]
    pp, cpp = -(-cap // page), -(-ncap // page)
    table, ctable = (rng.permutation(Bn * n + 2)[:Bn * n].reshape(Bn, n).astype(np.int32) for n in (pp, cpp))
    return [np.zeros((Bn * pp + 2, page, Hk, D), np.float32) for _ in range(2)] + [table], \
        [np.zeros((Bn * cpp + 2, page, Hk, D), np.float32) for _ in range(2)] + [ctable]


def _to_gpu(xs, dtype):
    return [TORCH.from_numpy(x).cuda() if x.dtype == np.int32 else TORCH.from_numpy(x).to("cuda", dtype) for x in xs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("D,G,page", [(128, 16, None), (128, 4, 64), (64, 1, 16), (64, 6, 128), (128, 2, 256)])
def test_tiled_step_matches_the_cpu_step(dtype, D, G, page):
    torch = TORCH
    dt = getattr(torch, dtype)
    rng = np.random.default_rng(D + G + (page or 0))
    lens, Hk = [2500, 0, 1, 1600], 2
    Bn, HQ, Tm, cap = len(lens), 2 * G, max(lens), 2600
    ncap = nsa.cmp_offsets(CFG, [0, cap])[1]
    q = _round(rng.standard_normal((Bn, Tm, HQ, D)).astype(np.float32), dt)
    k = _round(rng.standard_normal((Bn, Tm, Hk, D)).astype(np.float32), dt)
    v = _round(rng.standard_normal((Bn, Tm, Hk, D)).astype(np.float32), dt)
    gs = [_round(rng.random((Bn, Tm, HQ)).astype(np.float32), dt) for _ in range(3)]
    cpu_cache, cpu_cmp = _caches(rng, Bn, cap, Hk, D, page, ncap)
    gpu_cache, gpu_cmp = _to_gpu(cpu_cache, dt), _to_gpu(cpu_cmp, dt)
    L, rows, same_rows, worst = [0] * Bn, 0, 0, 0.0
    atol = 3e-2 if dtype == "bfloat16" else 6e-3
    for n in STEPS:
        cnt = [min(n, lens[b] - L[b]) for b in range(Bn)]
        Tq = max(max(cnt), 1)

        def take(x):
            return np.stack([np.concatenate([x[b, L[b]:L[b] + cnt[b]], np.zeros((Tq - cnt[b],) + x.shape[2:], x.dtype)])
                             for b in range(Bn)])
        args = [take(x) for x in (q, k, v)] + [take(x) for x in gs]
        seq, ql = np.array(L, np.int32), np.array(cnt, np.int32)
        o_ref, sel_ref, err = nsa.step(args[0], cpu_cache, seq, CFG, q_lens=ql, k_new=args[1], v_new=args[2],
                                       cmp_cache=cpu_cmp, g_cmp=args[3], g_slc=args[4], g_swa=args[5],
                                       return_selected=True, return_errors=True)
        assert (err == 0).all()
        t = [torch.from_numpy(x).cuda() for x in args]
        o, sel, err = nsa.step(t[0].to(dt), gpu_cache, torch.from_numpy(seq).cuda(), CFG, q_lens=torch.from_numpy(ql).cuda(),
                               k_new=t[1].to(dt), v_new=t[2].to(dt), cmp_cache=gpu_cmp, g_cmp=t[3].to(dt),
                               g_slc=t[4].to(dt), g_swa=t[5].to(dt),
                               return_selected=True, return_errors=True)
        assert (err.cpu().numpy() == 0).all()
        o, sel = o.float().cpu().numpy(), sel.cpu().numpy()
        for b in range(Bn):
            for i in range(cnt[b]):
                rows += 1
                if not (sel[b, i] == sel_ref[b, i]).all():  # a near-tie ordered the other way in fp32
                    continue
                same_rows += 1
                err_i = np.abs(o[b, i] - o_ref[b, i]) - atol * np.maximum(1.0, np.abs(o_ref[b, i]))
                worst = max(worst, float(err_i.max()))
            # rows past q_lens: o zero, selection -1 (written by the step, no fill of the caller)
            assert not o[b, cnt[b]:].any()
            assert (sel[b, cnt[b]:] == -1).all()
        L = [L[b] + cnt[b] for b in range(Bn)]
    assert worst <= 0.0, worst
    assert same_rows >= 0.98 * rows, (same_rows, rows)
    # the caches hold what the CPU's hold (appended tokens and pooled compressed rows)
    for g_x, c_x in zip(gpu_cache[:2] + gpu_cmp[:2], cpu_cache[:2] + cpu_cmp[:2]):
        np.testing.assert_allclose(g_x.float().cpu().numpy(), _round(c_x, dt), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(causal=True, window=(700, -1), softcap=3.0, sinks=True),
                                  dict(causal=False, window=(300, 90))])
@pytest.mark.parametrize("D,G,page", [(128, 16, 64), (64, 4, None), (128, 1, 16)])
def test_tiled_attention_step_matches_the_cpu(dtype, opts, D, G, page):
    torch = TORCH
    dt = getattr(torch, dtype)
    rng = np.random.default_rng(3 * D + G)
    lens, Hk = [2100, 1, 0, 900], 2
    Bn, HQ, Tm, cap = len(lens), 2 * G, max(lens), 2200
    opts = dict(opts)
    sinks = rng.standard_normal(HQ).astype(np.float32) if opts.pop("sinks", False) else None
    q = _round(rng.standard_normal((Bn, Tm, HQ, D)).astype(np.float32), dt)
    k = _round(rng.standard_normal((Bn, Tm, Hk, D)).astype(np.float32), dt)
    v = _round(rng.standard_normal((Bn, Tm, Hk, D)).astype(np.float32), dt)
    cpu_cache, _ = _caches(rng, Bn, cap, Hk, D, page, 1)
    gpu_cache = _to_gpu(cpu_cache, dt)
    L = [0] * Bn
    atol = 3e-2 if dtype == "bfloat16" else 6e-3
    for n in (1000, 1, 3, 1, 600, 1):
        cnt = [min(n, lens[b] - L[b]) for b in range(Bn)]
        Tq = max(max(cnt), 1)

        def take(x):
            return np.stack([np.concatenate([x[b, L[b]:L[b] + cnt[b]], np.zeros((Tq - cnt[b],) + x.shape[2:], x.dtype)])
                             for b in range(Bn)])
        qa, ka, va = take(q), take(k), take(v)
        seq, ql = np.array(L, np.int32), np.array(cnt, np.int32)
        o_ref, lse_ref, _ = nsa.attention_step(qa, cpu_cache, seq, q_lens=ql, k_new=ka, v_new=va, sinks=sinks,
                                               return_lse=True, return_errors=True, **opts)
        cu = lambda x: torch.from_numpy(x).cuda()  # noqa: E731
        o, lse, err = nsa.attention_step(cu(qa).to(dt), gpu_cache, cu(seq), q_lens=cu(ql), k_new=cu(ka).to(dt),
                                         v_new=cu(va).to(dt), sinks=None if sinks is None else cu(sinks),
                                         return_lse=True, return_errors=True, **opts)
        assert (err.cpu().numpy() == 0).all()
        o, lse = o.float().cpu().numpy(), lse.cpu().numpy()
        for b in range(Bn):
            c = cnt[b]
            np.testing.assert_array_less(np.abs(o[b, :c] - o_ref[b, :c]), atol * np.maximum(1.0, np.abs(o_ref[b, :c])) + 1e-7)
            np.testing.assert_allclose(lse[b, :c], lse_ref[b, :c], atol=2e-2, rtol=1e-3)
            assert not o[b, c:].any()
            assert (lse[b, c:] == -np.inf).all()
        L = [L[b] + cnt[b] for b in range(Bn)]


@pytest.mark.parametrize("case", ["nan_v", "nan_k", "neg_inf_scores"])
def test_tiled_step_non_finite_like_the_cpu(case):
    """Non-finite values reach exactly the outputs the CPU step gives them (spec 0.4): NaN in one
    column of a cached v, NaN in a cached k row, and a query whose scores are all -inf (every
    visible key scored -inf: 0 / 0, never an empty row). Compared NaN for NaN with the CPU step
    on the same inputs (the finite values within the tiles' tolerance)."""
    torch = TORCH
    dt = torch.bfloat16
    rng = np.random.default_rng(11)
    B, L0, Hk, G, D, cap = 1, 700, 2, 4, 64, 720
    HQ = Hk * G
    ncap = nsa.cmp_offsets(CFG, [0, cap])[1]
    k = _round(rng.standard_normal((B, L0 + 1, Hk, D)).astype(np.float32), dt)
    v = _round(rng.standard_normal((B, L0 + 1, Hk, D)).astype(np.float32), dt)
    q = _round(rng.standard_normal((B, 1, HQ, D)).astype(np.float32), dt)
    if case == "nan_v":
        v[0, 690, 1, 5] = np.nan  # in the window of the decode query: column 5 of kv head 1's rows
    elif case == "nan_k":
        k[0, 100, 0, :] = np.nan  # a compressed row and possibly a selected block of kv head 0
    else:
        k[0, :, 1, :] = np.abs(k[0, :, 1, :]) + 0.1  # every key of kv head 1 positive
        q[0, 0, G, :] = 0.0
        q[0, 0, G, 3] = -np.inf  # query head G (kv head 1): every score -inf
    gs = [_round(rng.random((B, 1, HQ)).astype(np.float32), dt) for _ in range(3)]
    cpu_cache, cpu_cmp = _caches(rng, B, cap, Hk, D, None, ncap)
    gpu_cache, gpu_cmp = _to_gpu(cpu_cache, dt), _to_gpu(cpu_cmp, dt)
    outs = []
    for dev in ("cpu", "cuda"):
        cache, cmp = (cpu_cache, cpu_cmp) if dev == "cpu" else (gpu_cache, gpu_cmp)
        cv = (lambda x: x) if dev == "cpu" else (lambda x: torch.from_numpy(np.ascontiguousarray(x)).cuda().to(dt))
        ci = (lambda x: x) if dev == "cpu" else (lambda x: torch.from_numpy(x).cuda())
        # the prefill, then one decode step
        nsa.step(cv(np.zeros((B, L0, HQ, D), np.float32)), cache,
                 ci(np.zeros(B, np.int32)), CFG, k_new=cv(k[:, :L0]), v_new=cv(v[:, :L0]), cmp_cache=cmp,
                 g_cmp=cv(np.zeros((B, L0, HQ), np.float32)))
        o = nsa.step(cv(q), cache, ci(np.full(B, L0, np.int32)), CFG, k_new=cv(k[:, L0:]), v_new=cv(v[:, L0:]),
                     cmp_cache=cmp, g_cmp=cv(gs[0]), g_slc=cv(gs[1]), g_swa=cv(gs[2]))
        outs.append(o if dev == "cpu" else o.float().cpu().numpy())
    o_cpu, o_gpu = outs
    np.testing.assert_array_equal(np.isnan(o_gpu), np.isnan(o_cpu))
    assert np.isnan(o_cpu).any()
    fin = np.isfinite(o_cpu)
    assert np.all(np.abs(o_gpu[fin] - o_cpu[fin]) <= 3e-2 * np.maximum(1.0, np.abs(o_cpu[fin])))
