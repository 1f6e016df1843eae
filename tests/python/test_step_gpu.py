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


def _inputs(rng, Bn, Tq, Tk, HQ, Hk, D, dt):
    """Random q [Bn, Tq, HQ, D], k / v [Bn, Tk, Hk, D] and three gates [Bn, Tq, HQ], rounded to dt."""
    q = _round(rng.standard_normal((Bn, Tq, HQ, D)).astype(np.float32), dt)
    k = _round(rng.standard_normal((Bn, Tk, Hk, D)).astype(np.float32), dt)
    v = _round(rng.standard_normal((Bn, Tk, Hk, D)).astype(np.float32), dt)
    return q, k, v, [_round(rng.random((Bn, Tq, HQ)).astype(np.float32), dt) for _ in range(3)]


def _rows_within(o, o_ref, sel, sel_ref, b, n, atol):
    """(rows, rows compared, worst excess over the tolerance) of sequence b's first n rows: a row
    whose selection differs from the reference's (a near-tie ordered the other way in fp32) is
    not compared."""
    same, worst = 0, -np.inf
    for i in range(n):
        if not (sel[b, i] == sel_ref[b, i]).all():
            continue
        same += 1
        worst = max(worst, float((np.abs(o[b, i] - o_ref[b, i]) - atol * np.maximum(1.0, np.abs(o_ref[b, i]))).max()))
    return n, same, worst


def _to_gpu(xs, dtype):
    return [TORCH.from_numpy(x).cuda() if x.dtype == np.int32 else TORCH.from_numpy(x).to("cuda", dtype) for x in xs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("D,G,page", [(128, 16, None), (128, 4, 64), (64, 1, 16), (64, 6, 128), (128, 2, 256)])
def test_tiled_step_matches_the_cpu_step(dtype, D, G, page):
    _tiled_step_case(dtype, D, G, page, "csw")


@pytest.mark.parametrize("gates", ["w", "c", "s", "cw", "sw", "cs"])
def test_tiled_step_branch_subsets(gates):
    """Steps with some branches off launch fewer kernels (a window-only step: the window kernel
    straight after the check kernel); each subset against the CPU step."""
    _tiled_step_case("bfloat16", 128, 16, 64, gates)


def _tiled_step_case(dtype, D, G, page, gates):
    torch = TORCH
    dt = getattr(torch, dtype)
    rng = np.random.default_rng(D + G + (page or 0))
    lens, Hk = [2500, 0, 1, 1600], 2
    Bn, HQ, Tm, cap = len(lens), 2 * G, max(lens), 2600
    ncap = nsa.cmp_offsets(CFG, [0, cap])[1]
    q, k, v, gs = _inputs(rng, Bn, Tm, Tm, HQ, Hk, D, dt)
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
        on = [x if c in gates else None for c, x in zip("csw", args[3:])]
        o_ref, sel_ref, err = nsa.step(args[0], cpu_cache, seq, CFG, q_lens=ql, k_new=args[1], v_new=args[2],
                                       cmp_cache=cpu_cmp, g_cmp=on[0], g_slc=on[1], g_swa=on[2],
                                       return_selected=True, return_errors=True)
        assert (err == 0).all()
        t = [torch.from_numpy(x).cuda() for x in args]
        on = [None if x is None else torch.from_numpy(x).to("cuda", dt) for x in on]
        o, sel, err = nsa.step(t[0].to(dt), gpu_cache, torch.from_numpy(seq).cuda(), CFG, q_lens=torch.from_numpy(ql).cuda(),
                               k_new=t[1].to(dt), v_new=t[2].to(dt), cmp_cache=gpu_cmp, g_cmp=on[0],
                               g_slc=on[1], g_swa=on[2], return_selected=True, return_errors=True)
        assert (err.cpu().numpy() == 0).all()
        assert (sel is None) == ("s" not in gates)
        o = o.float().cpu().numpy()
        if sel is None:
            sel, sel_ref = np.full((Bn, Tq, 1), -1), np.full((Bn, Tq, 1), -1)
        else:
            sel = sel.cpu().numpy()
        for b in range(Bn):
            r, sm, w = _rows_within(o, o_ref, sel, sel_ref, b, cnt[b], atol)
            rows, same_rows, worst = rows + r, same_rows + sm, max(worst, w)
            # rows past q_lens: o zero, selection -1 (written by the step, no fill of the caller)
            assert not o[b, cnt[b]:].any()
            assert (sel[b, cnt[b]:] == -1).all()
        L = [L[b] + cnt[b] for b in range(Bn)]
    assert worst <= 0.0, worst
    assert same_rows >= 0.98 * rows, (same_rows, rows)
    # the caches hold what the CPU's hold (appended tokens and pooled compressed rows)
    pooled = "c" in gates or "s" in gates
    for g_x, c_x in zip(gpu_cache[:2] + (gpu_cmp[:2] if pooled else []), cpu_cache[:2] + (cpu_cmp[:2] if pooled else [])):
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


def test_decode_loop_direct_path_equals_the_full_path(monkeypatch):
    """A decode loop hands the same tensors every step (caches, tables, gate and query buffers
    refilled in place, the lengths advanced in place): from its second call the step replays the
    recorded argument struct instead of the full Python path. Every step's output and the caches
    must equal those of the same loop on the full path (the record dropped before each call), bit
    for bit; an input that needs a copy (a query with a strided last dim) is never replayed."""
    torch = TORCH
    from nsa import _torch as nt
    hits = []
    run = nt._direct_run

    def spy(key, tensors):
        out = run(key, tensors)
        hits.append(out is not None)
        return out
    monkeypatch.setattr(nt, "_direct_run", spy)
    rng = np.random.default_rng(7)
    B, Hk, G, D, page, L0, steps = 3, 2, 4, 64, 16, 700, 40
    cap = L0 + steps
    ncap = nsa.cmp_offsets(CFG, [0, cap])[1]
    (kc, vc, table), (kcc, vcc, ctable) = _caches(rng, B, cap, Hk, D, page, ncap)
    tok = [rng.standard_normal(x.shape).astype(np.float32) for x in (kc, vc)]
    data = [rng.standard_normal((steps, B, 1) + s).astype(np.float32) for s in ((Hk * G, D), (Hk, D), (Hk, D))]
    gates = rng.random((steps, 3, B, 1, Hk * G)).astype(np.float32)
    dt = torch.bfloat16

    def loop(direct, q_layout=None):
        k, v, kcmp, vcmp = (torch.from_numpy(x).to("cuda", dt) for x in (tok[0], tok[1], kcc, vcc))
        bt, cbt = torch.from_numpy(table).cuda(), torch.from_numpy(ctable).cuda()
        seqlens = torch.full((B,), L0, dtype=torch.int32, device="cuda")
        after = seqlens + 1
        q = torch.empty((B, 1, Hk * G, D), dtype=dt, device="cuda") if q_layout is None else q_layout
        kn, vn = (torch.empty((B, 1, Hk, D), dtype=dt, device="cuda") for _ in range(2))
        g = torch.empty((3, B, 1, Hk * G), dtype=dt, device="cuda")
        outs = []
        for s in range(steps):
            q.copy_(torch.from_numpy(data[0][s])), kn.copy_(torch.from_numpy(data[1][s]))
            vn.copy_(torch.from_numpy(data[2][s])), g.copy_(torch.from_numpy(gates[s]))
            if not direct:
                nt._PREPARED.clear()
            o, sel, err = nsa.step(q, (k, v, bt), seqlens, CFG, k_new=kn, v_new=vn, cmp_cache=(kcmp, vcmp, cbt),
                                   g_cmp=g[0], g_slc=g[1], g_swa=g[2], return_selected=True, return_errors=True)
            if not direct:
                nt._PREPARED.clear()
            d, lse, _ = nsa.attention_step(q, (k, v, bt), after, return_lse=True)  # the tokens just appended
            outs.append((o.clone(), sel.clone(), err.clone(), d.clone(), lse.clone()))
            seqlens += 1
            after += 1
        return outs, (k, v, kcmp, vcmp)

    hits.clear()
    fast, fast_caches = loop(True)
    assert hits[:2] == [False, False] and all(hits[2:]), hits  # the step's and the dense step's first calls
    hits.clear()
    full, full_caches = loop(False)
    assert not any(hits)
    for s, (a, b) in enumerate(zip(fast, full)):
        assert (b[2] == 0).all()
        for x, y in zip(a, b):
            assert torch.equal(x, y), s
    for x, y in zip(fast_caches, full_caches):
        assert torch.equal(x, y)
    # a query whose last dim is strided is copied on each call: never replayed
    hits.clear()
    strided = torch.empty((B, 1, Hk * G, 2 * D), dtype=dt, device="cuda")[..., ::2]
    odd, _ = loop(True, strided)
    assert not any(hits)
    for a, b in zip(odd, full):
        assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3])


@pytest.mark.parametrize("gates", ["csw", "cw", "w", "dense"])
@pytest.mark.parametrize("page", [None, 64])
def test_tiled_read_only_step_checks_in_its_first_kernel(gates, page):
    """A step that writes nothing before it reads (no k_new, the compressed cache kept by the
    caller) has no check kernel: its first tiled kernel checks each sequence itself. Against the
    CPU step on a varlen batch (rows past q_lens, an idle sequence), then with one sequence's
    lengths or pages bad: that sequence's code in errors and its rows blank, the others as
    before."""
    _read_only_case(gates, page, [1500, 900, 40, 700], [1, 3, 0, 2], 2, 8, 1536, (None, "seqlen", "page"), 5)


@pytest.mark.parametrize("gates", ["csw", "dense"])
def test_tiled_step_long_context_merges_many_partials(gates):
    """One long sequence: the keys split over more than 32 tasks an item, so the combine takes
    a head a CTA with its warps over the partials (the layout of small batches at long
    contexts) -- against the CPU step."""
    _read_only_case(gates, 128, [16000], [1], 4, 16, 16384, (None,), 9)


def _paged_fill(x, table, b, src, page):
    """Rows 0 .. len(src) - 1 of sequence b of a cache (contiguous: table None) set to src."""
    if table is None:
        x[b, :src.shape[0]] = src
    else:
        r = np.arange(src.shape[0])
        x[table[b, r // page], r % page] = src


def _read_only_case(gates, page, lens, ql, Hk, G, cap, bads, seed):
    torch = TORCH
    dt = torch.bfloat16
    rng = np.random.default_rng(seed + (page or 0))
    D = 128
    Bn, HQ, Tq = len(lens), Hk * G, max(ql)
    ncap = nsa.cmp_offsets(CFG, [0, cap])[1]
    q, k, v, gs = _inputs(rng, Bn, Tq, cap, HQ, Hk, D, dt)
    cpu_cache, cpu_cmp = _caches(rng, Bn, cap, Hk, D, page, ncap)
    kc, vc = _round(nsa.compress(k, CFG), dt), _round(nsa.compress(v, CFG), dt)
    for b in range(Bn):  # the tokens and their compressed rows, written by the caller
        for x, src in ((cpu_cache[0], k), (cpu_cache[1], v)):
            _paged_fill(x, cpu_cache[2] if page else None, b, src[b], page)
        for x, src in ((cpu_cmp[0], kc), (cpu_cmp[1], vc)):
            _paged_fill(x, cpu_cmp[2] if page else None, b, src[b], page)
    seq, qln = np.array(lens, np.int32), np.array(ql, np.int32)
    on = [x if c in gates else None for c, x in zip("csw", gs)]

    def run(cache, cmp, seqlens, device):
        def conv(x):
            if device == "cpu" or x is None:
                return x
            return torch.from_numpy(x).cuda() if x.dtype == np.int32 else torch.from_numpy(x).to("cuda", dt)
        cache = [conv(x) for x in cache]
        if gates == "dense":
            o, sel, err = nsa.attention_step(conv(q), cache, conv(seqlens), q_lens=conv(qln), return_errors=True)
        else:
            o, sel, err = nsa.step(conv(q), cache, conv(seqlens), CFG, q_lens=conv(qln), cmp_cache=[conv(x) for x in cmp],
                                   cmp_by_caller=True, g_cmp=conv(on[0]), g_slc=conv(on[1]), g_swa=conv(on[2]),
                                   return_selected=True, return_errors=True)
        sel = np.zeros((Bn, Tq, 1), np.int32) if sel is None else sel if device == "cpu" else sel.cpu().numpy()
        return (o, sel, err) if device == "cpu" else (o.float().cpu().numpy(), sel, err.cpu().numpy())

    o_ref, sel_ref, _ = run(cpu_cache, cpu_cmp, seq, "cpu")
    rows = same = 0
    atol = 3e-2
    for bad in bads:
        seqlens, cache = seq.copy(), list(cpu_cache)
        if bad == "seqlen":
            seqlens[1] = cap + 1  # past the capacity
        elif bad == "page" and page is not None:
            cache[2] = cache[2].copy()
            cache[2][1, 3] = cache[0].shape[0]  # a page past the pool, in a row sequence 1 reads
        elif bad == "page":
            continue
        o, sel, err = run(cache, cpu_cmp, seqlens, "cuda")
        want = {None: 0, "seqlen": 4, "page": 6}[bad]  # nsa_step_error: OVER_CAPACITY, BAD_PAGE
        assert err.tolist() == [want if b == 1 else 0 for b in range(Bn)], err
        for b in range(Bn):
            if b == 1 and bad:
                assert not o[b].any() and (gates == "dense" or "s" not in gates or (sel[b] == -1).all())  # skipped: blank
                continue
            r, sm, w = _rows_within(o, o_ref, sel, sel_ref, b, ql[b], atol)
            rows, same = rows + r, same + sm
            assert w <= 0.0, (bad, b, w)
            assert not o[b, ql[b]:].any()
    assert same >= (rows - 1 if rows > 4 else rows), (same, rows)  # (fixed inputs: the same rows every run)
