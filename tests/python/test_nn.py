"""nsa.nn.NativeSparseAttention: shapes, gradients of every parameter, bf16, packed sequences,
torch.compile; and examples/train_tiny.py as a smoke run. Skips without torch."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import nsa  # noqa: E402
import nsa.nn  # noqa: E402
from conftest import ROOT, devices  # noqa: E402

DEVICES = devices()
CFG = nsa.Config(cmp_len=16, cmp_stride=8, slc_block=16, slc_topk=4, n_init=1, n_local=2, window=32)


def layer(device, dtype, **kw):
    torch.manual_seed(0)
    m = nsa.nn.NativeSparseAttention(128, num_heads=4, num_kv_heads=2, head_dim=64, config=CFG, **kw)
    return m.to(device=device, dtype=dtype)


def dtype_for(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("separate_kv", [False, True])
def test_forward_backward_all_parameters(device, separate_kv):
    dtype = dtype_for(device)
    m = layer(device, dtype, separate_kv=separate_kv)
    h = torch.randn(2, 100, 128, device=device, dtype=dtype, requires_grad=True)
    y, aux = m(h, return_aux=True)
    assert y.shape == h.shape and y.dtype == dtype
    assert aux.block_indices.shape == (2, 100, 2, 4)
    y.float().square().mean().backward()
    assert torch.isfinite(h.grad.float()).all()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad.float()).all(), name
        # every path (projections, gates, phi) reaches the loss; phi's first layer and position
        # embedding only once its zero-initialised output layer has moved
        if "_phi.fc1" not in name and "_phi.pos" not in name:
            assert p.grad.float().abs().sum() > 0, name


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_module(device):
    m = layer(device, torch.bfloat16)
    h = torch.randn(1, 70, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = m(h)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert torch.isfinite(m.k_phi.fc1.weight.grad.float()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_packed_sequences_match_separate(device):
    dtype = dtype_for(device)
    m = layer(device, dtype)
    lens = [37, 1, 0, 60]
    seqs = [torch.randn(1, n, 128, device=device, dtype=dtype) for n in lens]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    packed = m(torch.cat(seqs, 1), cu_seqlens=cu)
    for s, n in enumerate(lens):
        if n == 0:
            continue
        alone = m(seqs[s])
        tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(packed[:, cu[s]:cu[s + 1]], alone, **tol)


def test_compression_blocks():
    phi = nsa.nn.Compression(4, cmp_len=4, cmp_stride=2)
    x = torch.arange(10.0).view(1, 10, 1, 1).expand(1, 10, 1, 4)
    b = phi.blocks(x)
    assert b.shape == (1, 4, 1, 4, 4)
    assert b[0, 1, 0, :, 0].tolist() == [2, 3, 4, 5]
    packed = phi.blocks(x, cu_seqlens=[0, 5, 10])  # one block of 4 in each half, none across
    assert packed.shape == (1, 2, 1, 4, 4)
    assert packed[0, 1, 0, :, 0].tolist() == [5, 6, 7, 8]
    # zero-initialised fc2 and the residual mean: phi starts as the library's mean pooling
    y = phi(x)
    torch.testing.assert_close(y, b.mean(-2))


@pytest.mark.skipif(not hasattr(torch.library, "custom_op"), reason="torch < 2.4")
@pytest.mark.parametrize("device", DEVICES)
def test_compile_module(device):
    dtype = dtype_for(device)
    m = layer(device, dtype)
    h = torch.randn(2, 64, 128, device=device, dtype=dtype, requires_grad=True)
    torch._dynamo.reset()
    cm = torch.compile(m, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    y = cm(h)
    y.float().sum().backward()
    torch.testing.assert_close(y, m(h), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_module(device):
    torch.manual_seed(0)
    m = layer(device, torch.float32)
    h = torch.randn(1, 64, 128, device=device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        y = m(h)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert m.q_proj.weight.grad.dtype == torch.float32


def test_train_tiny_smoke(tmp_path):
    """examples/train_tiny.py end to end, tiny sizes, on the CPU: both losses printed, PNG written."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    ck = tmp_path / "tiny.pt"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_tiny.py"), "--tiny", "--steps", "4",
                        "--eval-every", "2", "--device", "cpu", "--out", str(tmp_path), "--save", str(ck)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "nsa" in r.stdout and "full" in r.stdout
    png = tmp_path / "loss.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "loss.csv").exists()
    # examples/generate.py on the saved model: cached greedy tokens equal the recomputed ones
    for extra in (["--page-size", "16"], ["--page-size", "0"]):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "generate.py"), "--checkpoint", str(ck),
                            "--device", "cpu", "--new-tokens", "12", "--prompt-len", "70"] + extra,
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        assert "cached vs recomputed: equal" in r.stdout and "tokens/s" in r.stdout


def test_generate_trains_when_no_checkpoint():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "generate.py"), "--device", "cpu", "--tiny",
                        "--train-steps", "20", "--new-tokens", "10", "--batch", "3"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "training the tiny NSA model" in r.stdout and "equal" in r.stdout


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("separate_kv,learnable", [(False, True), (True, True), (False, False), (True, False)])
@pytest.mark.parametrize("page_size", [None, 8])
def test_cached_steps_equal_forward(device, separate_kv, learnable, page_size):
    """forward(cache=...) over a prefill chunk, decode steps and multi-token steps, with a
    different count per sequence (some idle), gives forward()'s rows over the whole sequences:
    RoPE at the cached positions, phi of the blocks the new tokens complete, the three branches.
    A learnable phi runs in float32 on the GPU too: its bf16 matrix products round differently
    for one block than for all blocks at once (torch picks other kernels), which can move the
    top-n choice; that is torch's rounding, not the cache's."""
    dtype = torch.float32 if learnable else dtype_for(device)
    torch.manual_seed(0)
    m = nsa.nn.NativeSparseAttention(64, num_heads=4, num_kv_heads=2, head_dim=16, config=CFG, separate_kv=separate_kv,
                                     learnable_compression=learnable).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in m.parameters():  # away from the zero-initialised phi output, so phi matters
            p.normal_(0.0, 0.2)
    h = torch.randn(2, 90, 64, device=device, dtype=dtype)
    with torch.no_grad():
        full = m(h)
    cache = m.new_cache(2, 96, page_size=page_size)
    L, worst = [0, 0], 0.0
    for counts in ([30, 12], [1, 1], [5, 0], [1, 20], [53, 57]):
        Tq = max(counts)
        x = torch.stack([torch.cat([h[b, L[b]:L[b] + counts[b]], h.new_zeros(Tq - counts[b], 64)]) for b in range(2)])
        y = m(x, cache=cache, q_lens=counts)
        for b in range(2):
            if counts[b]:
                worst = max(worst, (y[b, :counts[b]] - full[b, L[b]:L[b] + counts[b]]).abs().max().item())
            L[b] += counts[b]
    assert cache.lengths == [90, 90]
    assert worst < ((5e-5 if device == "cpu" else 2e-4) if dtype == torch.float32 else 5e-2), worst


def test_cached_step_refuses_a_full_cache():
    m = layer("cpu", torch.float32)
    cache = m.new_cache(1, 40)
    h = torch.randn(1, 41, 128)
    with pytest.raises(ValueError, match="capacity"):
        m(h, cache=cache)
    assert cache.lengths == [0]
