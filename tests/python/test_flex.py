"""nsa.flex_attention / nsa.create_block_mask (spec 13, 14): FlexAttention's call form on the
CPU backend. Mods as Python callables (traced into the expression language) or strings; numpy
against a numpy reference; torch autograd (q, k, v and a captured tensor's gradient) against
torch's own float64 dense attention; the trace's refusals name what it cannot express."""
import numpy as np
import pytest

import nsa
import nsa.flex as F
from conftest import TORCH, devices

B, HQ, H, T, D = 2, 4, 2, 37, 16
DOC = np.arange(64) // 9
SLOPE = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)


def _qkv(seed=0, Tk=T):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, HQ, T, D)).astype(np.float32), rng.standard_normal((B, H, Tk, D)).astype(np.float32),
            rng.standard_normal((B, H, Tk, D)).astype(np.float32))


def _reference(q, k, v, visible, score):
    """Dense float64 attention over the visible pairs with the modified scores."""
    G = HQ // H
    Tq, Tk = q.shape[2], k.shape[2]
    i, j = np.meshgrid(np.arange(Tq), np.arange(Tk), indexing="ij")
    out = np.zeros(q.shape[:3] + (v.shape[3],))
    for b in range(B):
        for h in range(HQ):
            s = score((q[b, h].astype(np.float64) @ k[b, h // G].T.astype(np.float64)) / np.sqrt(D), b, h, i, j)
            s = np.where(visible(b, h, i, j), s, -np.inf)
            m = s.max(1, keepdims=True)
            p = np.where(np.isfinite(m), np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
            den = p.sum(1, keepdims=True)
            out[b, h] = np.where(den > 0, p / np.where(den > 0, den, 1), 0) @ v[b, h // G]
    return out


def doc_causal(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (DOC[q_idx] == DOC[kv_idx])


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPE[h] * abs(q_idx - kv_idx)


def test_trace_text_and_tensors():
    text, tensors = F.trace(doc_causal, "mask_mod")
    assert text == "((q_idx >= kv_idx) & (DOC[q_idx] == DOC[kv_idx]))" and set(tensors) == {"DOC"}
    text, tensors = F.trace(alibi, "score_mod")
    assert text == "(score - (SLOPE[h] * abs((q_idx - kv_idx))))" and set(tensors) == {"SLOPE"}
    w = 16
    assert F.trace(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx < w) & ~(kv_idx > q_idx), "mask_mod")[0] == \
        "(((q_idx - kv_idx) < 16) & (~(kv_idx > q_idx)))"


@pytest.mark.parametrize("bad,needle", [
    (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx if q_idx > 3 else False, "cannot branch on a value"),
    (lambda b, h, q_idx, kv_idx: min(q_idx, kv_idx) > 2, "cannot branch on a value"),
    (lambda b, h, q_idx, kv_idx: (q_idx ** 2) > kv_idx, "'\\*\\*' is not in the mod language"),
    (lambda b, h, q_idx, kv_idx: [1, 2, 3][q_idx] > 0, "cannot index a Python list"),
])
def test_trace_refusals_name_the_operation(bad, needle):
    with pytest.raises(TypeError, match=needle):
        F.trace(bad, "mask_mod")


def test_bad_expression_string_names_the_column():
    with pytest.raises(nsa.NsaError, match=r"mask_mod:10: unknown name 'kvidx'") as e:
        nsa.create_block_mask("q_idx >= kvidx", None, None, 16, 16, device=None, BLOCK_SIZE=8)
    assert e.value.name == "BAD_EXPRESSION"


@pytest.mark.parametrize("case", ["doc_causal+alibi", "softcap string, no block mask", "window, Tq != Tk"])
def test_numpy_against_reference(case):
    q, k, v = _qkv(1, Tk=45 if "Tq" in case else T)
    if case == "doc_causal+alibi":
        bm = nsa.create_block_mask(doc_causal, None, None, T, T, device=None, BLOCK_SIZE=8)
        o, lse = nsa.flex_attention(q, k, v, score_mod=alibi, block_mask=bm, enable_gqa=True, return_lse=True)
        ref = _reference(q, k, v, lambda b, h, i, j: (i >= j) & (DOC[i] == DOC[j]),
                         lambda s, b, h, i, j: s - SLOPE[h] * np.abs(i - j))
        assert lse.shape == (B, HQ, T)
    elif case == "softcap string, no block mask":
        o = nsa.flex_attention(q, k, v, score_mod="2.0 * tanh(score / 2.0)", enable_gqa=True)
        ref = _reference(q, k, v, lambda b, h, i, j: np.ones_like(i, bool), lambda s, b, h, i, j: 2.0 * np.tanh(s / 2.0))
    else:
        bm = nsa.create_block_mask("q_idx >= kv_idx - 8 && q_idx - kv_idx < 12", B, HQ, T, 45, device=None,
                                   BLOCK_SIZE=(8, 16))
        o = nsa.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
        ref = _reference(q, k, v, lambda b, h, i, j: (i >= j - 8) & (i - j < 12), lambda s, b, h, i, j: s)
    np.testing.assert_allclose(o, ref, atol=2e-5)


def test_block_mask_lists():
    bm = nsa.create_block_mask(doc_causal, None, None, T, T, device=None, BLOCK_SIZE=8)
    nqb = nkb = -(-T // 8)
    for qb in range(nqb):
        full, part = [], []
        for j in range(nkb):
            i, kv = np.meshgrid(np.arange(qb * 8, min(T, qb * 8 + 8)), np.arange(j * 8, min(T, j * 8 + 8)), indexing="ij")
            vis = (i >= kv) & (DOC[i] == DOC[kv])
            (full if vis.all() else part if vis.any() else []).append(j)
        assert list(bm.full_kv_indices[0, 0, qb, :bm.full_kv_num_blocks[0, 0, qb]]) == full
        assert list(bm.kv_indices[0, 0, qb, :bm.kv_num_blocks[0, 0, qb]]) == part


@pytest.mark.skipif(TORCH is None, reason="torch is not installed")
def test_torch_autograd_with_a_learnable_bias():
    torch = TORCH
    q, k, v = (torch.tensor(x, requires_grad=True) for x in _qkv(2))
    rel = torch.tensor(np.linspace(-1, 1, 2 * 64 + 1).astype(np.float32), requires_grad=True)
    doc = torch.tensor(DOC)

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

    def bias(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - kv_idx + 64]

    bm = nsa.create_block_mask(mask, None, None, T, T, BLOCK_SIZE=8)
    o = nsa.flex_attention(q, k, v, score_mod=bias, block_mask=bm, enable_gqa=True)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(0))
    (o * w).sum().backward()
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    relr = rel.detach().double().requires_grad_()
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    s = qr @ kr.repeat_interleave(HQ // H, 1).transpose(-1, -2) / D ** 0.5 + relr[i - j + 64]
    s = s.masked_fill(~((i >= j) & (doc[i] == doc[j])), float("-inf"))
    ref = torch.softmax(s, -1) @ vr.repeat_interleave(HQ // H, 1)
    (ref * w.double()).sum().backward()
    assert (o.detach().double() - ref.detach()).abs().max() < 2e-5
    for got, want in ((q, qr), (k, kr), (v, vr), (rel, relr)):
        err = (got.grad.double() - want.grad).abs().max().item()
        assert err < 2e-5 * max(1.0, want.grad.abs().max().item()), err


@pytest.mark.skipif(TORCH is None or not hasattr(TORCH.library, "custom_op"), reason="torch >= 2.4 is not installed")
def test_torch_compile_fullgraph():
    """nsa.flex_attention inside torch.compile(fullgraph=True), mods and block mask built
    outside (as FlexAttention's create_block_mask is): outputs and gradients equal eager."""
    torch = TORCH
    q, k, v = (torch.tensor(x, requires_grad=True) for x in _qkv(3))
    slope = torch.tensor(SLOPE, requires_grad=True)
    doc = torch.tensor(DOC)

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

    def bias(score, b, h, q_idx, kv_idx):
        return score - slope[h] * torch.abs(q_idx - kv_idx)

    bm = nsa.create_block_mask(mask, None, None, T, T, BLOCK_SIZE=8)
    score = F.Mod(bias, "score_mod")

    def f(q, k, v):
        return nsa.flex_attention(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True)

    outs, grads = [], []
    for fn in (f, torch.compile(f, fullgraph=True)):
        for x in (q, k, v, slope):
            x.grad = None
        o = fn(q, k, v)
        o.square().sum().backward()
        outs.append(o.detach())
        grads.append([x.grad.clone() for x in (q, k, v, slope)])
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.skipif(TORCH is None, reason="torch is not installed")
def test_torch_backward_without_a_score_mod():
    """A mask_mod alone (no tensors to differentiate): q, k, v gradients against dense float64."""
    torch = TORCH
    q, k, v = (torch.tensor(x, requires_grad=True) for x in _qkv(4))
    bm = nsa.create_block_mask("q_idx >= kv_idx", None, None, T, T, BLOCK_SIZE=8)
    o = nsa.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    o.square().sum().backward()
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    s = (qr @ kr.repeat_interleave(HQ // H, 1).transpose(-1, -2) / D ** 0.5).masked_fill(~(i >= j), float("-inf"))
    (torch.softmax(s, -1) @ vr.repeat_interleave(HQ // H, 1)).square().sum().backward()
    for got, want in ((q, qr), (k, kr), (v, vr)):
        assert (got.grad.double() - want.grad).abs().max().item() < 2e-5 * max(1.0, want.grad.abs().max().item())


@pytest.mark.skipif(TORCH is None or not TORCH.cuda.is_available() or not nsa.backend_available("cuda"),
                    reason="needs torch with a CUDA device and libnsa's CUDA backend")
def test_document_mask_with_gpu_tensors():
    """FlexAttention's document masking with the document ids on the GPU: create_block_mask
    evaluates on host copies (the same mask as from CPU ids), the CUDA forward reads the GPU
    tensor and equals the CPU's."""
    torch = TORCH
    T, H, D = 300, 4, 64
    doc_cpu = torch.arange(T, dtype=torch.int32) // 70
    doc = doc_cpu.cuda()

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

    def mask_cpu(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_cpu[q_idx] == doc_cpu[kv_idx])
    bm = nsa.create_block_mask(mask, None, None, T, T, device="cuda", BLOCK_SIZE=32)
    ref_bm = nsa.create_block_mask(mask_cpu, None, None, T, T, device="cpu", BLOCK_SIZE=32)
    for a, b in ((bm.kv_num_blocks, ref_bm.kv_num_blocks), (bm.kv_indices, ref_bm.kv_indices),
                 (bm.full_kv_num_blocks, ref_bm.full_kv_num_blocks)):
        assert torch.equal(a.cpu(), b.cpu())
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, H, T, D, generator=g) for _ in range(3))
    o = nsa.flex_attention(q.cuda(), k.cuda(), v.cuda(), block_mask=bm)
    ref = nsa.flex_attention(q, k, v, block_mask=ref_bm)
    assert (o.cpu() - ref).abs().max().item() < 1e-5


def _dense_torch(q, k, v, mask, score, scale):
    """Dense attention of [B, HQ, Tq, D] q against [B, H, Tk, D] k, v in their dtype and device
    (matmuls and softmax in that dtype; float64 for the reference), the mods applied to every pair;
    rows that see nothing give 0 and lse -inf."""
    torch = TORCH
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    dev = q.device
    b = torch.arange(q.shape[0], device=dev)[:, None, None, None]
    h = torch.arange(q.shape[1], device=dev)[None, :, None, None]
    i = torch.arange(q.shape[2], device=dev)[None, None, :, None]
    j = torch.arange(k.shape[2], device=dev)[None, None, None, :]
    s = (q @ k.transpose(-1, -2)) * scale
    if score is not None:
        s = score(s, b, h, i, j).to(s.dtype)
    if mask is not None:
        s = s.masked_fill(~mask(b, h, i, j), float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)  # rows without a finite score: 0
    return p.to(v.dtype) @ v, lse


@pytest.mark.skipif(TORCH is None or not TORCH.cuda.is_available() or not nsa.backend_available("cuda"),
                    reason="needs torch with a CUDA device and libnsa's CUDA backend")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", ["causal", "documents_alibi", "window_softcap", "hidden_scores", "prefix_alibi", "large_mod"])
def test_cuda_tensor_core_forward_within_the_tolerance_rule(dtype, D, case):
    """The CUDA forward of f16 / bf16 inputs with head dims 64 / 128 (the tensor-core kernels:
    on sm_90 the Hopper one where the q block is 128 rows -- no block mask, window_softcap,
    prefix_alibi with 64-key slices), o and lse against float64 dense attention within 2x the
    error of the same computation in the inputs' precision (the tolerance rule), GQA, lengths
    that are not multiples of 16 or of the blocks, partial and full blocks, captured GPU tensors,
    rows that see nothing."""
    torch = TORCH
    dt = getattr(torch, dtype)
    Bn, HQn, Hn, Tq, Tk = 2, 4, 2, 300, 333
    g = torch.Generator().manual_seed(11)
    q = torch.randn(Bn, HQn, Tq, D, generator=g).to("cuda", dt)
    k = torch.randn(Bn, Hn, Tk, D, generator=g).to("cuda", dt)
    v = torch.randn(Bn, Hn, Tk, D, generator=g).to("cuda", dt)
    doc = (torch.arange(Tk, dtype=torch.int32) // 70).cuda()
    slope = torch.tensor([0.5, 0.25, 0.125, 0.0625]).cuda()
    score_text = None
    if case == "causal":
        mask, score, blocks = (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx), None, (64, 64)
    elif case == "documents_alibi":
        def mask(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

        def score(s, b, h, q_idx, kv_idx):
            return s - slope[h] * torch.abs(q_idx - kv_idx)
        blocks = (32, 48)
    elif case == "window_softcap":
        def mask(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < 100)

        def score(s, b, h, q_idx, kv_idx):
            return 2.0 * torch.tanh(s / 2.0)
        blocks = 128
    elif case == "prefix_alibi":  # the engine's own (not a dense-route) mods, q blocks of 128, key blocks of 64
        def mask(b, h, q_idx, kv_idx):
            return (kv_idx < 50) | (q_idx >= kv_idx)

        def score(s, b, h, q_idx, kv_idx):
            return s - slope[h] * torch.abs(q_idx - kv_idx)
        blocks = (128, 64)
    elif case == "large_mod":  # mods too large to unroll over a tile's scores: the kernels' rolled loops
        def mask(b, h, q_idx, kv_idx):
            return ((q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])) | (kv_idx < 20)

        def score(s, b, h, q_idx, kv_idx):
            return torch.where(kv_idx % 3 == 0, s * 0.5, s * 2.0 + slope[h]) - 0.01 * torch.abs(q_idx - kv_idx) \
                + slope[(h + 1) % 4] * torch.tanh(s / 4.0)
        blocks = 128
    else:  # scores set to -inf (a row whose scores are all -inf sees nothing), no block mask
        mask, blocks = None, None
        score_text = "where(kv_idx % 3 == 0 || q_idx == 5, -exp(1000.0), score * 2)"

        def score(s, b, h, q_idx, kv_idx):
            return torch.where((kv_idx % 3 == 0) | (q_idx == 5), torch.full_like(s, float("-inf")), s * 2)
    bm = nsa.create_block_mask(mask, None, None, Tq, Tk, device="cuda", BLOCK_SIZE=blocks) if blocks else None
    scale = 0.3
    o, lse = nsa.flex_attention(q, k, v, score_mod=score_text or score, block_mask=bm, scale=scale, enable_gqa=True,
                                return_lse=True)
    ref_o, ref_lse = _dense_torch(q.double(), k.double(), v.double(), mask, score, scale)
    naive_o, naive_lse = _dense_torch(q, k, v, mask, score, scale)
    assert torch.isfinite(o).all()
    err, naive = (o.double() - ref_o).abs().max().item(), (naive_o.double() - ref_o).abs().max().item()
    assert err <= 2 * naive + 1e-6, (case, err, naive)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse[~fin] == float("-inf")).all()
    lerr = (lse.double() - ref_lse)[fin].abs().max().item()
    lnaive = (naive_lse.double() - ref_lse)[fin].abs().max().item()
    assert lerr <= 2 * lnaive + 1e-5, (case, lerr, lnaive)
    if case == "hidden_scores":
        assert (o[:, :, 5] == 0).all() and (lse[:, :, 5] == float("-inf")).all()


@pytest.mark.skipif(TORCH is None or not TORCH.cuda.is_available() or not nsa.backend_available("cuda"),
                    reason="needs torch with a CUDA device and libnsa's CUDA backend")
def test_cuda_forward_hides_a_nan_in_a_key_a_row_does_not_see():
    """A NaN in V at a key some rows do not see reaches only the rows that see it (the tensor-core
    kernel multiplies every pair of its slice: such a call runs on the scalar kernel)."""
    torch = TORCH
    g = torch.Generator().manual_seed(5)
    T, D = 200, 64
    q, k, v = (torch.randn(1, 2, T, D, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    v[0, 0, 150] = float("nan")
    bm = nsa.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, T, T, device="cuda",
                               BLOCK_SIZE=64)
    o = nsa.flex_attention(q, k, v, block_mask=bm)
    assert torch.isfinite(o[0, :, :150]).all() and torch.isfinite(o[0, 1]).all()
    assert torch.isnan(o[0, 0, 150:]).all()
    vz = v.clone()
    vz[0, 0, 150] = 0
    ref = nsa.flex_attention(q, k, vz, block_mask=bm)  # (on the tensor cores: P rounded to bf16 there)
    assert (o[0, :, :150].float() - ref[0, :, :150].float()).abs().max().item() < 3e-2


@pytest.mark.skipif(TORCH is None or not TORCH.cuda.is_available() or not nsa.backend_available("cuda"),
                    reason="needs torch with a CUDA device and libnsa's CUDA backend")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", ["documents_rel_bias", "window_softcap", "hidden_no_block_mask", "prefix_alibi", "large_mod"])
def test_cuda_backward_within_the_tolerance_rule(dtype, case):
    """The CUDA backward through autograd: dq, dk, dv and a learnable bias table's gradient against
    float64 dense attention, within 2x the error of the same computation in the inputs' precision
    (f32: within 2e-5 of the largest); GQA, Tq != Tk, partial and full blocks, no block mask with
    scores sent to -inf (an expression string with its tensor); deterministic. On sm_90 the 128
    blocks (hidden_no_block_mask, prefix_alibi with D = 128: listed partial and full blocks;
    large_mod, whose mods the kernels walk in their rolled loops) take the Hopper kernels."""
    torch = TORCH
    dt = getattr(torch, dtype)
    Bn, HQn, Hn, Tq, Tk, D = 2, 4, 2, 150, 173, 128 if case == "prefix_alibi" else 64
    g = torch.Generator().manual_seed(13)
    q0, k0, v0 = (torch.randn(Bn, n, t, D, generator=g) for n, t in ((HQn, Tq), (Hn, Tk), (Hn, Tk)))
    rel0 = torch.randn(HQn, 2 * Tk + 1, generator=g) * 0.3
    w = torch.randn(Bn, HQn, Tq, D, generator=g)
    doc = (torch.arange(Tk, dtype=torch.int32) // 60).cuda()

    def run(dev_dtype, device, use_nsa):
        q, k, v = (x.to(device, dev_dtype).requires_grad_() for x in (q0, k0, v0))
        rel = rel0.to(device, torch.float32 if dev_dtype != torch.float64 else torch.float64).requires_grad_()
        if case == "documents_rel_bias":
            def mask(b, h, q_idx, kv_idx):
                return (q_idx + (Tk - Tq) >= kv_idx) & (doc[q_idx] == doc[kv_idx])

            def score(s, b, h, q_idx, kv_idx):
                return s + rel[h, q_idx - kv_idx + Tk]
            blocks = (32, 48)
        elif case == "window_softcap":
            def mask(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (q_idx - kv_idx < 70)

            def score(s, b, h, q_idx, kv_idx):
                return 2.0 * torch.tanh(s / 2.0) + rel[h, 0]
            blocks = 64
        elif case == "prefix_alibi":  # a learnable ALiBi slope on a prefix-LM mask
            def mask(b, h, q_idx, kv_idx):
                return (kv_idx < 40) | (q_idx + (Tk - Tq) >= kv_idx)

            def score(s, b, h, q_idx, kv_idx):
                return s - rel[h, 2] * torch.abs(q_idx - kv_idx)
            blocks = 128
        elif case == "large_mod":  # mods too large to unroll: the rolled loops, a learnable table read twice
            def mask(b, h, q_idx, kv_idx):
                return ((q_idx + (Tk - Tq) >= kv_idx) & (doc[q_idx] == doc[kv_idx])) | (kv_idx < 20)

            def score(s, b, h, q_idx, kv_idx):
                return torch.where(kv_idx % 3 == 0, s * 0.5, s * 2.0 + rel[h, 1]) - 0.01 * torch.abs(q_idx - kv_idx) \
                    + rel[h, 3] * torch.tanh(s / 4.0)
            blocks = 128
        else:  # every key block partial (FlexAttention's 128 blocks), a third of the keys hidden by the score
            mask, blocks = None, None

            def score(s, b, h, q_idx, kv_idx):
                return torch.where(kv_idx % 3 == 0, torch.full_like(s, float("-inf")), s * 2.0 + rel[h, 1])
        if use_nsa and blocks is None:
            text = "where(kv_idx % 3 == 0, -exp(1000.0), score * 2.0 + rel[h, 1])"
            o = nsa.flex_attention(q, k, v, score_mod=text, scale=0.2, enable_gqa=True, tensors={"rel": rel})
        elif use_nsa:
            bm = nsa.create_block_mask(mask, None, None, Tq, Tk, device="cuda", BLOCK_SIZE=blocks)
            o = nsa.flex_attention(q, k, v, score_mod=score, block_mask=bm, scale=0.2, enable_gqa=True)
        else:
            o, _ = _dense_torch(q, k, v, mask, score, 0.2)
        (o.to(torch.float64) * w.to(device, torch.float64)).sum().backward()
        return [x.grad.to(torch.float64).cpu() for x in (q, k, v, rel)]

    ref = run(torch.float64, "cuda", False)
    got = run(dt, "cuda", True)
    again = run(dt, "cuda", True)
    naive = run(dt, "cuda", False)
    for i, name in enumerate(("dq", "dk", "dv", "drel")):
        assert torch.equal(got[i], again[i]), name + ": two runs differ"
        err = (got[i] - ref[i]).abs().max().item()
        # the tolerance rule: twice the naive same-precision error plus the fp32 accumulation
        # floor, 2^-18 of max(|ref|, 16) (a bias gradient that softmax makes exactly 0 is a sum
        # of ~10^4 cancelling fp32 terms: only the floor bounds it)
        bound = (naive[i] - ref[i]).abs().max().item()
        floor = 2.0 ** -18 * max(ref[i].abs().max().item(), 16.0)
        assert err <= 2 * (bound + floor), (name, err, bound, floor)


@pytest.mark.skipif(TORCH is None or not TORCH.cuda.is_available() or not nsa.backend_available("cuda"),
                    reason="needs torch with a CUDA device and libnsa's CUDA backend")
def test_cuda_backward_keeps_a_nan_query_in_its_own_row():
    """A NaN in one query row reaches only that row's gradient and the keys it sees, as dense
    attention's backward would (the tensor-core kernels multiply every pair of a tile: such a call
    runs on the scalar kernels)."""
    torch = TORCH
    g = torch.Generator().manual_seed(7)
    T, D = 100, 64
    q, k, v = (torch.randn(1, 2, T, D, generator=g).to("cuda", torch.bfloat16).requires_grad_() for _ in range(3))
    with torch.no_grad():
        q[0, 0, 5] = float("nan")
    bm = nsa.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, T, T, device="cuda",
                               BLOCK_SIZE=32)
    o = nsa.flex_attention(q, k, v, block_mask=bm)
    o.float().sum().backward()
    rows = torch.arange(T, device="cuda") != 5
    assert torch.isnan(q.grad[0, 0, 5]).all() and torch.isfinite(q.grad[0, 0, rows]).all()
    assert torch.isnan(k.grad[0, 0, :6]).all() and torch.isfinite(k.grad[0, 0, 6:]).all()
    assert torch.isnan(v.grad[0, 0, :6]).all() and torch.isfinite(v.grad[0, 0, 6:]).all()
    assert all(torch.isfinite(x.grad[0, 1]).all() for x in (q, k, v))


@pytest.mark.skipif(TORCH is None, reason="torch is not installed")
def test_torch_tensor_gradients_only_where_wanted():
    """Of a score_mod's two float tensors, only the one that requires grad gets a gradient (the
    other costs the backward nothing); q, k, v's gradients are those of the call where both do."""
    torch = TORCH
    q, k, v = (torch.tensor(x, requires_grad=True) for x in _qkv(4))
    slope = torch.tensor(SLOPE, requires_grad=True)
    rel = torch.tensor(np.linspace(-1, 1, 2 * 64 + 1).astype(np.float32))

    def score(s, b, h, q_idx, kv_idx):
        return s - slope[h] * torch.abs(q_idx - kv_idx) + rel[q_idx - kv_idx + 64]

    o = nsa.flex_attention(q, k, v, score_mod=score, enable_gqa=True)
    o.sum().backward()
    assert slope.grad is not None and rel.grad is None
    grads = [x.grad.clone() for x in (q, k, v, slope)]
    for x in (q, k, v, slope):
        x.grad = None
    rel.requires_grad_()
    nsa.flex_attention(q, k, v, score_mod=score, enable_gqa=True).sum().backward()
    assert rel.grad is not None and rel.grad.abs().sum() > 0
    for got, x in zip(grads, (q, k, v, slope)):
        assert torch.equal(got, x.grad)


@pytest.mark.skipif(TORCH is None, reason="torch is not installed")
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", ["causal", "window", "documents", "softcap"])
def test_dense_route_is_nsa_attention(device, case):
    """Mods that are attention options (spec 14, the dense route) run as nsa.attention with those
    options: on the CPU the same kernel on the same inputs, so the output and every gradient are
    equal bit for bit; on CUDA equal within bf16 rounding (the two calls' output layouts may pick
    different tiles)."""
    torch = TORCH
    Tn, Hn, Dn, W = 75, 2, 32, 20
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    docs = (torch.arange(Tn, dtype=torch.int32) // 17).to(device)
    mask = {"causal": lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
            "window": lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < W),
            "documents": lambda b, h, q_idx, kv_idx: (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx),
            "softcap": lambda b, h, q_idx, kv_idx: q_idx >= kv_idx}[case]
    score = (lambda s, b, h, q_idx, kv_idx: 20.0 * torch.tanh(s / 20.0)) if case == "softcap" else None
    opts = {"causal": dict(causal=True), "window": dict(causal=True, window=(W - 1, -1)),
            "documents": dict(causal=True, cu_seqlens=[0, 17, 34, 51, 68, Tn]),
            "softcap": dict(causal=True, softcap=20.0)}[case]
    g = torch.Generator().manual_seed(11)
    base = [torch.randn(1, Hn, Tn, Dn, generator=g).to(device, dt) for _ in range(4)]
    bm = nsa.create_block_mask(mask, None, None, Tn, Tn, device=device, BLOCK_SIZE=16)
    q, k, v = (x.clone().requires_grad_() for x in base[:3])
    o = nsa.flex_attention(q, k, v, score_mod=score, block_mask=bm)
    (o.float() * base[3].float()).sum().backward()
    q2, k2, v2 = (x.clone().requires_grad_() for x in base[:3])
    o2 = nsa.attention(q2.transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2), **opts).o.transpose(1, 2)
    (o2.float() * base[3].float()).sum().backward()
    for got, want in ((o, o2), (q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        if device == "cpu":
            assert torch.equal(got, want)
        else:
            assert (got.float() - want.float()).abs().max().item() <= 2e-2 * max(1.0, want.float().abs().max().item())


@pytest.mark.skipif(TORCH is None or not TORCH.cuda.is_available() or not nsa.backend_available("cuda"),
                    reason="needs torch with a CUDA device and libnsa's CUDA backend")
def test_cuda_dense_route_leaves_out_unchanged_lists():
    """create_block_mask's lists for a mask the dense route takes from the mods alone add nothing
    to the mask_mod: nsa.flex_attention leaves them out (no copy to the host, no synchronisation).
    Written into afterwards (their _version moves), they are passed again and the call follows
    them: here a query block's diagonal block dropped, so its rows see only the first block."""
    torch = TORCH
    Tn, Hn, Dn = 300, 2, 128
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, Hn, Tn, Dn, generator=g).to("cuda", torch.bfloat16) for _ in range(3))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    bm = nsa.create_block_mask(causal, None, None, Tn, Tn, device="cuda", BLOCK_SIZE=128)
    assert F._lists_add_nothing(bm, q, k, bm.mask_mod, None) == ()
    assert F._lists_add_nothing(bm, q, k[:, :, :200], bm.mask_mod, None) is None  # other lengths: the lists count
    lists = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    other = nsa.BlockMask(*lists, BLOCK_SIZE=128, mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 64)
    assert F._lists_add_nothing(other, q, k, other.mask_mod, None) is None  # the same lists, another mask_mod
    resized = nsa.BlockMask(*lists, BLOCK_SIZE=64, mask_mod=bm.mask_mod)
    assert F._lists_add_nothing(resized, q, k, bm.mask_mod, None) is None  # other block sizes: the call checks them
    q3 = q.expand(3, -1, -1, -1)
    bm2 = nsa.create_block_mask(causal, 2, None, Tn, Tn, device="cuda", BLOCK_SIZE=128)
    assert F._lists_add_nothing(bm2, q3, k, bm2.mask_mod, None) is None  # lists of 2 batch entries, q of 3: refused
    o = nsa.flex_attention(q, k, v, block_mask=bm)
    want = nsa.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).o.transpose(1, 2)
    assert (o.float() - want.float()).abs().max().item() <= 2e-2
    assert bm.full_kv_indices[0, 0, 1, 0].item() == 0 and bm.kv_indices[0, 0, 1, 0].item() == 1
    bm.kv_num_blocks[0, 0, 1] = 0  # query block 1 (rows 128..255): its partial diagonal block dropped
    assert F._lists_add_nothing(bm, q, k, bm.mask_mod, None) is None
    o = nsa.flex_attention(q, k, v, block_mask=bm)
    ref, _ = _dense_torch(q.double(), k.double(), v.double(),
                          lambda b, h, i, j: torch.where((i >= 128) & (i < 256), j < 128, i >= j), None, Dn ** -0.5)
    assert (o.float() - ref.float()).abs().max().item() <= 2e-2


@pytest.mark.skipif(TORCH is None or not TORCH.cuda.is_available() or not nsa.backend_available("cuda"),
                    reason="needs torch with a CUDA device and libnsa's CUDA backend")
def test_cuda_dense_route_keeps_rows_of_minus_inf_scores_empty():
    """bf16, head dim 128 (the attention tiles): finite q rows whose every score overflows to -inf
    make an empty row on the dense route as in the engine (o = 0, lse = -inf, dq = 0), +inf
    scores a NaN row (whose keys' dk, dv are NaN), and the other rows are plain causal attention."""
    torch = TORCH
    Tn, Hn, Dn = 300, 2, 128
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, Hn, Tn, Dn, generator=g)
    k = torch.rand(1, Hn, Tn, Dn, generator=g) + 0.1  # positive: the signs of q decide
    v = torch.randn(1, Hn, Tn, Dn, generator=g)
    q[0, 0, 200] = -1e37  # every score of row 200, head 0: -inf
    q[0, 1, 3] = 1e37     # row 3, head 1: +inf scores
    q, k, v = (x.to("cuda", torch.bfloat16).requires_grad_() for x in (q, k, v))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    bm = nsa.create_block_mask(causal, None, None, Tn, Tn, device="cuda", BLOCK_SIZE=128)
    o, lse = nsa.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert lse[0, 0, 200].item() == float("-inf") and (o[0, 0, 200] == 0).all()
    assert torch.isnan(lse[0, 1, 3]) and torch.isnan(o[0, 1, 3]).all()
    keep = torch.ones(Hn, Tn, dtype=torch.bool, device="cuda")
    keep[0, 200] = keep[1, 3] = False
    ref, _ = _dense_torch(q.detach().double(), k.detach().double(), v.detach().double(), causal, None, Dn ** -0.5)
    assert (o[0][keep].float() - ref[0][keep].float()).abs().max().item() <= 2e-2
    o.float().sum().backward()
    assert (q.grad[0, 0, 200] == 0).all()
    assert torch.isfinite(k.grad[0, 1, 4:]).all() and torch.isfinite(v.grad[0, 1, 4:]).all()
    assert torch.isnan(v.grad[0, 1, :4]).any() and torch.isfinite(k.grad[0, 0]).all()


@pytest.mark.skipif(TORCH is None or not TORCH.cuda.is_available() or not nsa.backend_available("cuda"),
                    reason="needs torch with a CUDA device and libnsa's CUDA backend")
def test_cuda_document_route_takes_the_runs_create_block_mask_read():
    """A document mask: create_block_mask reads the ids once, and while neither they nor the lists
    are written into, calls pass the ids' runs (doc_runs) instead of the lists, and the route reads
    nothing from the device. Ids written into afterwards are read again: the result follows them."""
    torch = TORCH
    Tn, Hn, Dn = 400, 2, 128
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, Hn, Tn, Dn, generator=g).to("cuda", torch.bfloat16).requires_grad_() for _ in range(3))
    doc = (torch.arange(Tn, dtype=torch.int32) // 90).cuda()

    def docs(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    bm = nsa.create_block_mask(docs, None, None, Tn, Tn, device="cuda", BLOCK_SIZE=128)
    spare = F._lists_add_nothing(bm, q, k, bm.mask_mod, None)
    assert spare is not None and spare[1] == 5 and list(spare[0]) == [0, 90, 180, 270, 360, 400]
    for step in range(2):
        o = nsa.flex_attention(q, k, v, block_mask=bm)
        ref, _ = _dense_torch(q.detach().double(), k.detach().double(), v.detach().double(),
                              lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), None, Dn ** -0.5)
        assert (o.float() - ref.float()).abs().max().item() <= 2e-2
        o.float().sum().backward()
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
        doc[150:] += 10  # a new document starts at 150 (the mod reads doc's storage)
        assert F._lists_add_nothing(bm, q, k, bm.mask_mod, None) is None
        q.grad = k.grad = v.grad = None


@pytest.mark.skipif(TORCH is None, reason="torch is not installed")
def test_create_block_mask_under_inference_mode():
    """Tensors made under torch.inference_mode have no version counter: create_block_mask still
    works there (its lists are then always passed)."""
    torch = TORCH
    with torch.inference_mode():
        bm = nsa.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 64, 64, device="cpu",
                                   BLOCK_SIZE=16)
        q = torch.randn(1, 2, 64, 16)
        o = nsa.flex_attention(q, q, q, block_mask=bm)
    assert o.shape == (1, 2, 64, 16) and torch.isfinite(o).all()
