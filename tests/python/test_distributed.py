"""nsa.distributed (context parallelism) on the CPU with gloo: P = 2 and P = 3 processes, each
holding its zigzag part of the sequences, must give the single-process call's rows of the
output and of every gradient (q, k, v, the three gates), for lengths that P and the block sizes
do not divide and for chunks that are empty. The query-chunk building block itself is checked
against the float64 reference in tests/test_chunk.c; here each rank compares with the whole
call it runs itself on the same inputs. Skips without torch or torch.distributed."""
import os
import socket

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
dist = pytest.importorskip("torch.distributed", reason="torch.distributed is not available")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
mp = pytest.importorskip("torch.multiprocessing")

import nsa  # noqa: E402
from conftest import devices  # noqa: E402


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _case_inputs(seed, B, T, HQ, H, DK, DV, gates):
    gen = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(B, T, HQ, DK, generator=gen), k=torch.randn(B, T, H, DK, generator=gen),
             v=torch.randn(B, T, H, DV, generator=gen))
    for i, name in enumerate(("g_cmp", "g_slc", "g_swa")):
        x[name] = torch.rand(B, T, HQ, generator=gen) if gates >> i & 1 else None
    x["dout"] = torch.randn(B, T, HQ, DV, generator=gen)
    return x


CONFIG = dict(cmp_len=8, cmp_stride=4, slc_block=16, slc_topk=4, n_init=1, n_local=2, window=24)
CASES = {  # backend -> [(seed, B, T, HQ, H, DK, DV, gates)]
    "gloo": [(1, 1, 203, 4, 2, 16, 16, 7), (2, 2, 97, 2, 1, 8, 12, 3),
             (3, 1, 5, 4, 4, 8, 8, 7),  # T < 2P: empty chunks
             (4, 1, 150, 6, 2, 16, 8, 6)],
    "nccl": [(1, 1, 2003, 16, 2, 64, 64, 7), (2, 2, 997, 8, 2, 128, 128, 3), (3, 1, 5, 4, 4, 64, 64, 7)],
}


def _rank_main(rank, world, port, errors_path, backend="gloo"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    from nsa import distributed as cp
    bad = []

    def same(a, b):  # the CPU in float32: the same bits; CUDA in bf16: within its rounding
        if not cuda:
            return torch.equal(a, b)
        return (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item() + 1e-3

    try:
        cfg = nsa.Config(**CONFIG)
        for case in CASES[backend]:
            seed, B, T, HQ, H, DK, DV, gates = case
            x = _case_inputs(seed, B, T, HQ, H, DK, DV, gates)
            if cuda:
                x = {n: None if t is None else t.to("cuda", torch.bfloat16) for n, t in x.items()}
            names = ["q", "k", "v", "g_cmp", "g_slc", "g_swa"]
            # the whole call, on this rank
            whole = {n: None if x[n] is None else x[n].clone().requires_grad_(True) for n in names}
            o = nsa.native_sparse_attention(whole["q"], whole["k"], whole["v"], whole["g_cmp"], whole["g_slc"],
                                            whole["g_swa"], config=cfg)
            (o.float() * x["dout"].float()).sum().backward()
            # this rank's part through context parallelism
            part = {n: None if x[n] is None else cp.shard(x[n], rank, world).clone().requires_grad_(True) for n in names}
            o_cp = cp.native_sparse_attention(part["q"], part["k"], part["v"], part["g_cmp"], part["g_slc"],
                                              part["g_swa"], config=cfg, seq_len=T)
            (o_cp.float() * cp.shard(x["dout"], rank, world).float()).sum().backward()
            if not same(o_cp, cp.shard(o.detach(), rank, world)):
                bad.append("case %s: o differs (max %.3g)" % (case, (o_cp - cp.shard(o.detach(), rank, world)).abs().max()))
            if not same(cp.gather(o_cp.detach(), T), o.detach()):
                bad.append("case %s: gather(o) is not the whole o" % (case,))
            for n in names:
                if whole[n] is None:
                    continue
                want = cp.shard(whole[n].grad, rank, world)
                got = part[n].grad
                ok = got is not None and (same(got, want) if cuda else torch.allclose(got, want, rtol=1e-5, atol=1e-6))
                if not ok:
                    err = "none" if got is None else "%.3g" % (got - want).abs().max()
                    bad.append("case %s: d%s differs (max %s)" % (case, n, err))
            pos = cp.positions(T, rank, world)
            if not torch.equal(pos, cp.shard(torch.arange(T)[None], rank, world)[0]):
                bad.append("case %s: positions disagree with shard" % (case,))
    except Exception as e:  # reported by the parent, with the rank
        bad.append("%s: %s" % (type(e).__name__, e))
    finally:
        dist.destroy_process_group()
    with open("%s.%d" % (errors_path, rank), "w") as f:
        f.write("\n".join(bad))


def _backends():
    out = [("gloo", 2), ("gloo", 3)]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and nsa.backend_available("cuda") else 0
    mark = pytest.mark.skipif(gpus < 2 or not dist.is_nccl_available(), reason="needs 2 GPUs, NCCL and libnsa's CUDA backend")
    out.append(pytest.param("nccl", 2, marks=mark, id="cuda-nccl-2"))
    return out


@pytest.mark.parametrize("backend,world", _backends())
def test_context_parallel_matches_single_process(backend, world, tmp_path):
    errors = str(tmp_path / "errors")
    mp.spawn(_rank_main, args=(world, _free_port(), errors, backend), nprocs=world, join=True)
    report = []
    for r in range(world):
        with open("%s.%d" % (errors, r)) as f:
            text = f.read().strip()
        if text:
            report.append("rank %d: %s" % (r, text))
    assert not report, "\n".join(report)


def test_layout_helpers():
    from nsa import distributed as cp
    for T in (0, 1, 7, 64, 203):
        for world in (1, 2, 3, 8):
            b = cp.zigzag_bounds(T, world)
            assert b[0] == 0 and b[-1] == T and all(b[i] <= b[i + 1] for i in range(len(b) - 1))
            x = torch.arange(T)[None, :, None]
            parts = [cp.shard(x, r, world) for r in range(world)]
            assert sum(p.shape[1] for p in parts) == T
            assert [p.shape[1] for p in parts] == [cp.local_length(T, r, world) for r in range(world)]
            assert torch.equal(cp._assemble(parts, T), x)
            assert torch.equal(torch.sort(torch.cat([cp.positions(T, r, world) for r in range(world)]))[0],
                               torch.arange(T))
    with pytest.raises(ValueError):
        cp.zigzag_bounds(10, 0)


def test_needs_a_process_group():
    from nsa import distributed as cp
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="process group"):
        cp.native_sparse_attention(q, q[:, :, :1], q[:, :, :1], None, torch.ones(1, 4, 2), None, seq_len=4)


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
