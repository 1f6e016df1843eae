"""nsa.step (the inference step, spec 12) and parallel_nsa's decoding forms: a prefill and
decode steps over contiguous and paged caches give nsa.forward's rows; a decode against a
caller-kept cache; refusals name the argument; torch on the CPU and CUDA (when present), and
fla's call forms (q shorter than k; cu_seqlens=(cu_q, cu_k)) against parallel_nsa on the
whole sequences."""
import numpy as np
import pytest

import nsa
from conftest import TORCH

CFG = nsa.Config(8, 4, 16, 4, 1, 1, 20, 0.3, 0.0)
B, T, HQ, H, D = 2, 70, 4, 2, 16


def _data(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, HQ, D)).astype(np.float32)
    k = rng.standard_normal((B, T, H, D)).astype(np.float32)
    v = rng.standard_normal((B, T, H, D)).astype(np.float32)
    g = [rng.random((B, T, HQ)).astype(np.float32) for _ in range(3)]
    return q, k, v, g


def test_step_prefill_and_decode_equal_forward():
    q, k, v, g = _data()
    ref = nsa.forward(q, k, v, *g, config=CFG)
    cap, ncap = 80, 19
    K, V = np.zeros((B, cap, H, D), np.float32), np.zeros((B, cap, H, D), np.float32)
    KC, VC = np.zeros((B, ncap, H, D), np.float32), np.zeros((B, ncap, H, D), np.float32)
    L, outs, sels = 0, [], []
    for n in (40, 1, 1, 7, 21):
        o, sel, err = nsa.step(q[:, L:L + n], (K, V), np.full(B, L, np.int32), CFG, k_new=k[:, L:L + n],
                               v_new=v[:, L:L + n], cmp_cache=(KC, VC), g_cmp=g[0][:, L:L + n], g_slc=g[1][:, L:L + n],
                               g_swa=g[2][:, L:L + n], return_selected=True, return_errors=True)
        assert (err == 0).all()
        outs.append(o), sels.append(sel)
        L += n
    np.testing.assert_allclose(np.concatenate(outs, 1), ref.o, atol=2e-5)
    assert (np.concatenate(sels, 1) == ref.aux.block_indices).all()
    np.testing.assert_array_equal(K[:, :T], k)  # the appends landed
    np.testing.assert_allclose(KC[:, :nsa.cmp_offsets(CFG, [0, T])[1]], nsa.compress(k, CFG), atol=1e-6)


def test_step_paged_decode_with_caller_cache():
    q, k, v, g = _data(1)
    ref = nsa.forward(q, k, v, *g, config=CFG).o
    page, pages = 8, 9
    rng = np.random.default_rng(3)
    perm = rng.permutation(B * pages + 2).astype(np.int32)
    table = perm[:B * pages].reshape(B, pages)
    K = np.zeros((B * pages + 2, page, H, D), np.float32)
    V = np.zeros_like(K)
    for b in range(B):
        for r in range(T):
            K[table[b, r // page], r % page] = k[b, r]
            V[table[b, r // page], r % page] = v[b, r]
    kc, vc = nsa.compress(k, CFG), nsa.compress(v, CFG)
    # sequence 0 asks for its last 3 tokens, sequence 1 for its last 2 (its row 2 is padding)
    last = lambda x: np.stack([x[0, -3:], np.concatenate([x[1, -2:], x[1, -1:]])])  # noqa: E731
    o, sel, _ = nsa.step(last(q), (K, V, table), np.full(B, T, np.int32), CFG, q_lens=np.array([3, 2], np.int32),
                         cmp_cache=(kc, vc), cmp_by_caller=True, g_cmp=last(g[0]), g_slc=last(g[1]), g_swa=last(g[2]),
                         return_selected=True)
    np.testing.assert_allclose(o[0], ref[0, -3:], atol=2e-5)
    np.testing.assert_allclose(o[1, :2], ref[1, -2:], atol=2e-5)
    assert (o[1, 2] == 0).all() and (sel[1, 2] == -1).all()  # past q_lens: zero, no selection
    assert (sel[1, :2] >= 0).any()


def test_step_refusals_name_the_argument():
    q, k, v, g = _data()
    K = np.zeros((B, 8, H, D), np.float32)
    with pytest.raises(nsa.NsaError, match=r"seqlens\[0\].*capacity") as e:
        nsa.step(q[:, :1], (K, K.copy()), np.full(B, 8, np.int32), CFG, k_new=k[:, :1], v_new=v[:, :1], g_swa=g[2][:, :1])
    assert e.value.name == "BAD_ARGUMENT"
    with pytest.raises(nsa.NsaError, match=r"cmp_cache\.k") as e:
        nsa.step(q[:, :1], (K, K.copy()), np.zeros(B, np.int32), CFG, k_new=k[:, :1], v_new=v[:, :1], g_cmp=g[0][:, :1])
    assert e.value.name == "NULL_POINTER"


def _torch_devices():
    if TORCH is None:
        return []
    devs = ["cpu"]
    if TORCH.cuda.is_available() and nsa.backend_available("cuda"):
        devs.append("cuda")
    return devs


@pytest.mark.skipif(TORCH is None, reason="torch is not installed")
@pytest.mark.parametrize("device", _torch_devices())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parallel_nsa_decoding_forms(device, dtype):
    torch = TORCH
    dt = getattr(torch, dtype)
    g_ = torch.Generator().manual_seed(0)
    Bq, Tk, Tq, HQq, Hk, K, S, bs, W = 2, 150, 5, 16, 1, 32, 4, 16, 24
    q = torch.rand((Bq, Tk, HQq, K), generator=g_).mul(3).sub(2).to(dt).to(device)
    k = torch.rand((Bq, Tk, Hk, K), generator=g_).mul(3).sub(2).to(dt).to(device)
    v = torch.rand((Bq, Tk, Hk, K), generator=g_).mul(3).sub(2).to(dt).to(device)
    gc, gs, gw = torch.rand((3, Bq, Tk, HQq), generator=g_).to(dt).to(device).unbind(0)
    full = nsa.parallel_nsa(q, k, v, gc, gs, gw, block_counts=S, block_size=bs, window_size=W, scale=0.1)
    tol = 2e-5 if dtype == "float32" else 2e-2
    # q shorter than k: the last Tq positions, the selection computed
    dec = nsa.parallel_nsa(q[:, -Tq:], k, v, gc[:, -Tq:], gs[:, -Tq:], gw[:, -Tq:], block_counts=S, block_size=bs,
                           window_size=W, scale=0.1)
    assert dec.shape == (Bq, Tq, HQq, K) and dec.dtype == dt
    assert (dec.float() - full[:, -Tq:].float()).abs().max().item() < tol
    # packed sequences, (cu_q, cu_k): each sequence's last q_lens tokens
    lens, q_lens = [60, 1, 89], [3, 1, 5]
    cu_k = torch.tensor([0, 60, 61, 150], dtype=torch.int32, device=device)
    cu_q = torch.tensor([0, 3, 4, 9], dtype=torch.int32, device=device)
    full_p = nsa.parallel_nsa(q[:1], k[:1], v[:1], gc[:1], gs[:1], gw[:1], block_counts=S, block_size=bs, window_size=W,
                              scale=0.1, cu_seqlens=cu_k)
    starts = [0, 60, 61]
    rows = torch.tensor([s + L - n + i for s, L, n in zip(starts, lens, q_lens) for i in range(n)])
    pick = lambda x: x[:, rows.to(x.device)]  # noqa: E731
    dec_p = nsa.parallel_nsa(pick(q[:1]), k[:1], v[:1], pick(gc[:1]), pick(gs[:1]), pick(gw[:1]), block_counts=S,
                             block_size=bs, window_size=W, scale=0.1, cu_seqlens=(cu_q, cu_k))
    assert dec_p.shape == (1, 9, HQq, K)
    assert (dec_p.float() - pick(full_p).float()).abs().max().item() < tol


@pytest.mark.parametrize("page_size", [None, 8])
def test_kv_cache_object(page_size):
    """nsa.KVCache: a prefill and decode steps (different counts per sequence) give
    nsa.forward's rows; freeing a sequence returns its pages and it starts over; a step the
    pool cannot hold raises before anything changes."""
    q, k, v, g = _data(2)
    ref = nsa.forward(q, k, v, *g, config=CFG).o
    cache = nsa.KVCache(B, H, D, D, 72, CFG, page_size=page_size)
    L = [0, 0]
    for counts in ([30, 12], [1, 1], [5, 0], [1, 20], [33, 37]):
        Tq = max(counts)
        take = lambda x: np.stack([np.concatenate([x[b, L[b]:L[b] + counts[b]],  # noqa: E731
                                                   np.zeros((Tq - counts[b],) + x.shape[2:], x.dtype)]) for b in range(B)])
        o = cache.step(take(q), take(k), take(v), q_lens=counts, g_cmp=take(g[0]), g_slc=take(g[1]), g_swa=take(g[2]))
        for b in range(B):
            np.testing.assert_allclose(o[b, :counts[b]], ref[b, L[b]:L[b] + counts[b]], atol=2e-5)
            L[b] += counts[b]
    assert cache.lengths == [T, T]
    cache.free(1)
    assert cache.lengths == [T, 0]
    o = cache.step(q[:, :4], k[:, :4], v[:, :4], q_lens=[0, 4], g_cmp=g[0][:, :4], g_slc=g[1][:, :4], g_swa=g[2][:, :4])
    np.testing.assert_allclose(o[1], ref[1, :4], atol=2e-5)
    with pytest.raises((ValueError, MemoryError)):
        cache.step(q[:, :4], k[:, :4], v[:, :4], q_lens=[4, 0], g_swa=g[2][:, :4])  # 70 + 4 > 72
    assert cache.lengths == [T, 4]
    if page_size:
        small = nsa.KVCache(B, H, D, D, 72, CFG, page_size=8, num_pages=5)  # 40 tokens in all
        small.step(q[:, :24], k[:, :24], v[:, :24], g_swa=g[2][:, :24], q_lens=[24, 0])
        with pytest.raises(MemoryError):
            small.step(q[:, :24], k[:, :24], v[:, :24], g_swa=g[2][:, :24], q_lens=[0, 24])
        assert small.lengths == [24, 0]


@pytest.mark.skipif(TORCH is None, reason="torch is not installed")
@pytest.mark.parametrize("device", _torch_devices())
def test_kv_cache_object_torch(device):
    """nsa.KVCache with torch storage on the tensor's device: prefill + decode equal nsa.forward."""
    torch = TORCH
    qn, kn, vn, gn = _data(4)
    q, k, v = (torch.from_numpy(x).to(device) for x in (qn, kn, vn))
    g = [torch.from_numpy(x).to(device) for x in gn]
    ref = nsa.forward(q, k, v, *g, config=CFG).o
    cache = nsa.KVCache(B, H, D, D, 80, CFG, page_size=16, like=q)
    outs = [cache.step(q[:, :40], k[:, :40], v[:, :40], g_cmp=g[0][:, :40], g_slc=g[1][:, :40], g_swa=g[2][:, :40])]
    for t in range(40, T):
        outs.append(cache.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g_cmp=g[0][:, t:t + 1],
                               g_slc=g[1][:, t:t + 1], g_swa=g[2][:, t:t + 1]))
    assert (torch.cat(outs, 1) - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("opts", [dict(causal=True), dict(causal=True, window=(9, -1), softcap=2.5, sinks=True),
                                  dict(causal=False, window=(5, 3))])
@pytest.mark.parametrize("page", [None, 8])
def test_attention_step_equals_attention(opts, page):
    """Prefill then decode / multi-token steps through nsa.attention_step: each step's o and lse
    are nsa.attention of its queries over the tokens cached so far (bottom-right aligned)."""
    q, k, v, _ = _data(4)
    opts = dict(opts)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32) if opts.pop("sinks", False) else None
    cap = 72
    if page is None:
        cache = (np.zeros((B, cap, H, D), np.float32), np.zeros((B, cap, H, D), np.float32))
    else:
        pages = cap // page
        table = np.random.default_rng(5).permutation(B * pages).astype(np.int32).reshape(B, pages)
        cache = (np.zeros((B * pages, page, H, D), np.float32), np.zeros((B * pages, page, H, D), np.float32), table)
    L = 0
    for n in (30, 1, 1, 5, 33):
        o, lse, err = nsa.attention_step(q[:, L:L + n], cache, np.full(B, L, np.int32), k_new=k[:, L:L + n],
                                         v_new=v[:, L:L + n], scale=0.3, sinks=sinks, return_lse=True, return_errors=True,
                                         **opts)
        assert (err == 0).all()
        ref = nsa.attention(q[:, L:L + n], k[:, :L + n], v[:, :L + n], scale=0.3, sinks=sinks, **opts)
        np.testing.assert_allclose(o, ref.o, atol=2e-5)
        np.testing.assert_allclose(lse, ref.lse, atol=2e-5)
        L += n


def test_attention_step_refusals_name_the_argument():
    q, k, v, _ = _data(5)
    cache = (np.zeros((B, 8, H, D), np.float32), np.zeros((B, 8, H, D), np.float32))
    before = cache[0].copy()
    with pytest.raises(nsa.NsaError, match=r"seqlens\[0\].*capacity"):
        nsa.attention_step(q[:, :2], cache, np.full(B, 7, np.int32), k_new=k[:, :2], v_new=v[:, :2])
    with pytest.raises(nsa.NsaError, match=r"softcap"):
        nsa.attention_step(q[:, :2], cache, np.zeros(B, np.int32), k_new=k[:, :2], v_new=v[:, :2], softcap=-1.0)
    np.testing.assert_array_equal(cache[0], before)  # nothing written


@pytest.mark.skipif(TORCH is None or not hasattr(TORCH.library, "custom_op"), reason="torch >= 2.4 is not installed")
@pytest.mark.parametrize("device", _torch_devices())
def test_steps_under_torch_compile(device):
    """torch.ops.nsa.step / attention_step under torch.compile(fullgraph=True): the appends land in
    the caches (mutated arguments) and the outputs equal the eager calls'; on CUDA the compiled
    decode step also replays from a captured CUDA graph with new lengths."""
    torch = TORCH
    qn, kn, vn, gn = _data(6)
    q, k, v = (torch.from_numpy(x).to(device) for x in (qn, kn, vn))
    g = [torch.from_numpy(x).to(device) for x in gn]
    cap, ncap = 80, 19

    def fresh():
        return ([torch.zeros(B, cap, H, D, device=device) for _ in range(2)],
                [torch.zeros(B, ncap, H, D, device=device) for _ in range(2)])

    def decode(q1, k1, v1, g1, kc, vc, kcc, vcc, lens):
        o = nsa.step(q1, (kc, vc), lens, CFG, k_new=k1, v_new=v1, cmp_cache=(kcc, vcc), g_cmp=g1[0], g_slc=g1[1],
                     g_swa=g1[2])
        d = nsa.attention_step(q1, (kc, vc), lens + 1, causal=True, scale=0.3)  # the tokens just appended
        return o, d

    compiled = torch.compile(decode, fullgraph=True)
    (ke, ve), (kce, vce) = fresh()
    (kc, vc), (kcc, vcc) = fresh()
    for L in range(0, 12):
        lens = torch.full((B,), L, dtype=torch.int32, device=device)
        args = (q[:, L:L + 1], k[:, L:L + 1], v[:, L:L + 1], [x[:, L:L + 1] for x in g])
        o_e, d_e = decode(*args, ke, ve, kce, vce, lens)
        o_c, d_c = compiled(*args, kc, vc, kcc, vcc, lens)
        assert (o_e - o_c).abs().max().item() < 1e-6 and (d_e - d_c).abs().max().item() < 1e-6
    assert torch.equal(kc, ke) and torch.equal(vcc, vce) and torch.equal(kc[:, :12], k[:, :12])
    ref = nsa.attention(q[:, :12], k[:, :12], v[:, :12], causal=True, scale=0.3).o
    assert (d_c - ref[:, 11:12]).abs().max().item() < 2e-5
    if device != "cuda":
        return
    # a CUDA graph of one decode step, replayed for later positions (lengths read on the device)
    lens = torch.full((B,), 12, dtype=torch.int32, device=device)
    q1, k1, v1 = (torch.zeros(B, 1, *x.shape[2:], device=device) for x in (q, k, v))
    g1 = [torch.zeros(B, 1, HQ, device=device) for _ in range(3)]

    def load(L):
        lens.fill_(L)
        for dst, src in ((q1, q), (k1, k), (v1, v)):
            dst.copy_(src[:, L:L + 1])
        for dst, src in zip(g1, g):
            dst.copy_(src[:, L:L + 1])

    load(12)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        decode(q1, k1, v1, g1, kc, vc, kcc, vcc, lens)  # warm-up: position 12 written
    torch.cuda.current_stream().wait_stream(s)
    load(12)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, _ = decode(q1, k1, v1, g1, kc, vc, kcc, vcc, lens)
    full = nsa.forward(q, k, v, *g, config=CFG).o
    for L in range(12, 20):
        load(L)
        graph.replay()
        torch.cuda.synchronize()
        assert (o_g - full[:, L:L + 1]).abs().max().item() < 2e-5, L


@pytest.mark.skipif(TORCH is None or not hasattr(TORCH.library, "custom_op"), reason="torch >= 2.4 is not installed")
@pytest.mark.parametrize("device", _torch_devices())
def test_eager_steps_call_the_library_directly(device, monkeypatch):
    """Plain eager tensors skip the custom op's dispatch (its cost is a decode step's budget): the
    direct call gives the op's outputs bit for bit, appends the same rows, and moves the caches'
    version counters as the op's mutates_args does; lists as lengths work on both paths."""
    torch = TORCH
    from nsa import _torch as nt
    qn, kn, vn, gn = _data(7)
    q, k, v = (torch.from_numpy(x).to(device) for x in (qn, kn, vn))
    g = [torch.from_numpy(x).to(device) for x in gn]
    results = []
    for direct in (True, False):
        monkeypatch.setattr(nt, "plain_eager", (lambda *t: True) if direct else (lambda *t: False))
        kc, vc = (torch.zeros(B, 40, H, D, device=device) for _ in range(2))
        kcc, vcc = (torch.zeros(B, 9, H, D, device=device) for _ in range(2))
        versions = [t._version for t in (kc, vc, kcc, vcc)]
        outs = []
        for L in (0, 5):
            n = 5 if L == 0 else 1
            outs.append(nsa.step(q[:, L:L + n], (kc, vc), [L] * B, CFG, k_new=k[:, L:L + n], v_new=v[:, L:L + n],
                                 cmp_cache=(kcc, vcc), g_cmp=g[0][:, L:L + n], g_slc=g[1][:, L:L + n],
                                 g_swa=g[2][:, L:L + n]))
        outs.append(nsa.attention_step(q[:, 5:6], (kc, vc), [6] * B, causal=True))
        assert all(t._version > v0 for t, v0 in zip((kc, vc, kcc, vcc), versions))
        results.append(outs + [kc, vc, kcc, vcc])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    monkeypatch.undo()
    assert nt.plain_eager(q, None, k) and not nt.plain_eager(q, torch.nn.Parameter(k))


@pytest.mark.skipif(TORCH is None, reason="torch is not installed")
@pytest.mark.parametrize("device", _torch_devices())
def test_tensor_views_follow_in_place_changes(device):
    """The call keeps each input tensor's C view (beside the tensor) for the next call; a tensor whose
    memory or shape changed in place since (set_, .data =, resize_) must be read anew, as a fresh
    tensor with the same values would be."""
    torch = TORCH
    qn, kn, vn, _ = _data(11)
    q = torch.from_numpy(qn).to(device)[:, 5:6]
    kc, vc = (torch.from_numpy(x).to(device)[:, :6].contiguous() for x in (kn, vn))
    first = nsa.attention_step(q, (kc, vc), [6] * B, causal=True)
    assert torch.equal(first, nsa.attention_step(q, (kc, vc), [6] * B, causal=True))  # the kept views
    k2 = torch.from_numpy(kn[:, ::-1].copy()).to(device)[:, :6].contiguous()
    kc.set_(k2.clone())  # other memory, same shape
    want = nsa.attention_step(q, (k2, vc), [6] * B, causal=True)
    assert torch.equal(nsa.attention_step(q, (kc, vc), [6] * B, causal=True), want)
    assert not torch.equal(want, first)
    vc.data = torch.from_numpy(vn[:, ::-1].copy()).to(device)[:, :6].contiguous()  # other memory
    want = nsa.attention_step(q, (k2, vc.clone()), [6] * B, causal=True)
    assert torch.equal(nsa.attention_step(q, (kc, vc), [6] * B, causal=True), want)
    kc.resize_(B, 5, H, D)  # other shape: five cached rows, the query at position 4
    want = nsa.attention_step(q, (kc.clone(), vc[:, :5].contiguous()), [5] * B, causal=True)
    assert torch.equal(nsa.attention_step(q, (kc, vc[:, :5].contiguous()), [5] * B, causal=True), want)
    # nothing is kept on the tensors themselves: they still save, copy and pickle
    import copy
    import io
    import pickle
    buf = io.BytesIO()
    torch.save({"k": kc, "v": vc}, buf)
    assert torch.equal(copy.deepcopy(vc), vc) and torch.equal(pickle.loads(pickle.dumps(kc)), kc)
    assert not hasattr(kc, "_nsa_view") and not kc.__dict__


def _all_backends():
    return ["numpy"] + ["torch-" + d for d in _torch_devices()]


@pytest.mark.parametrize("backend", _all_backends())
@pytest.mark.parametrize("G,page", [(1, 16), (2, 32), (4, 64), (6, 128), (16, 256), (16, None)])
def test_step_group_sizes_and_page_sizes(backend, G, page):
    """Prefill chunks, decode and multi-token steps over a varlen batch (an empty sequence, a
    length-1 one, lengths crossing compression and selection blocks), dk != dv, shuffled pages of
    every size: each step's rows equal nsa.forward's over the whole sequences, selections too."""
    rng = np.random.default_rng(G * 7 + (page or 0))
    cfg = nsa.Config(16, 8, 32, 4, 1, 1, 40, 0.0, 0.0)
    lens, Hk, DK, DV = [300, 0, 1, 97], 2, 24, 16
    Bn, HQn, Tm = len(lens), 2 * G, max(lens)
    q = rng.standard_normal((Bn, Tm, HQn, DK)).astype(np.float32)
    k = rng.standard_normal((Bn, Tm, Hk, DK)).astype(np.float32)
    v = rng.standard_normal((Bn, Tm, Hk, DV)).astype(np.float32)
    gs = [rng.random((Bn, Tm, HQn)).astype(np.float32) for _ in range(3)]
    refs = [nsa.forward(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], *[x[b:b + 1, :n] for x in gs], config=cfg)
            if n else None for b, n in enumerate(lens)]
    cap = 320
    ncap = nsa.cmp_offsets(cfg, [0, cap])[1]
    if page is None:
        cache = [np.zeros((Bn, cap, Hk, D), np.float32) for D in (DK, DV)]
        cmp_cache = [np.zeros((Bn, ncap, Hk, D), np.float32) for D in (DK, DV)]
    else:
        pp, cpp = -(-cap // page), -(-ncap // page)
        perm, cperm = rng.permutation(Bn * pp + 1), rng.permutation(Bn * cpp + 1)
        cache = [np.zeros((Bn * pp + 1, page, Hk, D), np.float32) for D in (DK, DV)]
        cache.append(perm[:Bn * pp].reshape(Bn, pp).astype(np.int32))
        cmp_cache = [np.zeros((Bn * cpp + 1, page, Hk, D), np.float32) for D in (DK, DV)]
        cmp_cache.append(cperm[:Bn * cpp].reshape(Bn, cpp).astype(np.int32))
    if backend != "numpy":
        torch = TORCH
        dev = backend.split("-")[1]
        conv = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(dev)  # noqa: E731
        cache, cmp_cache = [conv(x) for x in cache], [conv(x) for x in cmp_cache]
    else:
        conv = np.ascontiguousarray
    L = [0] * Bn
    for step_i in range(400):
        want = [rng.integers(40, 120) if step_i == 0 else rng.integers(0, 4) if step_i % 3 else rng.integers(0, 9)
                for _ in lens]
        cnt = [int(min(w, n - l)) for w, n, l in zip(want, lens, L)]
        if sum(n - l for n, l in zip(lens, L)) == 0:
            break
        Tq = max(max(cnt), 1)
        take = lambda x: np.stack([np.concatenate([x[b, L[b]:L[b] + cnt[b]],  # noqa: E731
                                                   np.zeros((Tq - cnt[b],) + x.shape[2:], x.dtype)]) for b in range(Bn)])
        o, sel, err = nsa.step(conv(take(q)), cache, conv(np.array(L, np.int32)), cfg,
                               q_lens=conv(np.array(cnt, np.int32)), k_new=conv(take(k)), v_new=conv(take(v)),
                               cmp_cache=cmp_cache, g_cmp=conv(take(gs[0])), g_slc=conv(take(gs[1])),
                               g_swa=conv(take(gs[2])), return_selected=True, return_errors=True)
        o, sel, err = [x.cpu().numpy() if hasattr(x, "cpu") else x for x in (o, sel, err)]
        assert (err == 0).all()
        for b in range(Bn):
            if cnt[b]:
                np.testing.assert_allclose(o[b, :cnt[b]], refs[b].o[0, L[b]:L[b] + cnt[b]], atol=3e-5)
                assert (sel[b, :cnt[b]] == refs[b].aux.block_indices[0, L[b]:L[b] + cnt[b]]).all()
            L[b] += cnt[b]
    assert L == lens
