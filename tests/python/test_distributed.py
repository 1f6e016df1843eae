"""nsa.distributed (context parallelism) on the CPU with gloo: P = 2, 3 and 8 processes, each
holding its zigzag part of the sequences, must give the single-process call's rows of the
output and of every gradient (q, k, v, the three gates), for lengths that P and the block sizes
do not divide and for chunks that are empty, in float32 and bf16, with the collectives
overlapped with the chunks' computation and without (overlap=False), which must also agree with
each other bit for bit (the same collectives and the same sums in the same order). The
query-chunk building block itself is checked against the float64 reference in
tests/test_chunk.c (and on the GPU by test_chunk.py); here each rank compares with the whole call
it runs itself on the same inputs. Skips without torch or torch.distributed."""
import os
import socket

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
dist = pytest.importorskip("torch.distributed", reason="torch.distributed is not available")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
mp = pytest.importorskip("torch.multiprocessing")

import nsa  # noqa: E402


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
CASES = {  # backend -> [(seed, B, T, HQ, H, DK, DV, gates[, dtype])], float32 on the CPU unless named
    "gloo": [(1, 1, 203, 4, 2, 16, 16, 7), (2, 2, 97, 2, 1, 8, 12, 3),
             (3, 1, 5, 4, 4, 8, 8, 7),  # T < 2P: empty chunks
             (4, 1, 150, 6, 2, 16, 8, 6),
             (5, 2, 130, 4, 2, 16, 8, 7, torch.bfloat16)],  # dK / dV pieces added in float32, rounded once
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

    def same(a, b):  # float32 on the CPU: the same bits; bf16: within its rounding
        if a.dtype == torch.float32:
            return torch.equal(a, b)
        return (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item() + 1e-3

    try:
        cfg = nsa.Config(**CONFIG)
        for case in CASES[backend]:
            seed, B, T, HQ, H, DK, DV, gates = case[:8]
            x = _case_inputs(seed, B, T, HQ, H, DK, DV, gates)
            if cuda or len(case) > 8:
                x = {n: None if t is None else t.to("cuda" if cuda else "cpu", torch.bfloat16 if cuda else case[8])
                     for n, t in x.items()}
            names = ["q", "k", "v", "g_cmp", "g_slc", "g_swa"]
            # the whole call, on this rank
            whole = {n: None if x[n] is None else x[n].clone().requires_grad_(True) for n in names}
            o = nsa.native_sparse_attention(whole["q"], whole["k"], whole["v"], whole["g_cmp"], whole["g_slc"],
                                            whole["g_swa"], config=cfg)
            (o.float() * x["dout"].float()).sum().backward()
            # this rank's part through context parallelism, computing while the collectives run and
            # waiting for each: the same collectives and sums, so the same bits
            got = {}
            for overlap in (True, False):
                part = {n: None if x[n] is None else cp.shard(x[n], rank, world).clone().requires_grad_(True) for n in names}
                o_cp = cp.native_sparse_attention(part["q"], part["k"], part["v"], part["g_cmp"], part["g_slc"],
                                                  part["g_swa"], config=cfg, seq_len=T, overlap=overlap)
                (o_cp.float() * cp.shard(x["dout"], rank, world).float()).sum().backward()
                got[overlap] = [o_cp.detach()] + [part[n].grad for n in names if part[n] is not None]
                tag = "case %s, overlap %s" % (case, overlap)
                if not same(o_cp, cp.shard(o.detach(), rank, world)):
                    bad.append("%s: o differs (max %.3g)" % (tag, (o_cp - cp.shard(o.detach(), rank, world)).abs().max()))
                if not same(cp.gather(o_cp.detach(), T), o.detach()):
                    bad.append("%s: gather(o) is not the whole o" % tag)
                for n in names:
                    if whole[n] is None:
                        continue
                    want = cp.shard(whole[n].grad, rank, world)
                    g = part[n].grad
                    ok = g is not None and (torch.allclose(g, want, rtol=1e-5, atol=1e-6) if g.dtype == torch.float32
                                            else same(g, want))
                    if not ok:
                        err = "none" if g is None else "%.3g" % (g - want).abs().max()
                        bad.append("%s: d%s differs (max %s)" % (tag, n, err))
            if not all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(got[True], got[False])):
                bad.append("case %s: overlap on and off give different bits" % (case,))
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
    out = [("gloo", 2), ("gloo", 3), ("gloo", 8)]  # 8: the ranks of an 8-GPU node, on the CPU
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
    # the exchanges: a rank's second chunk's key-side partial (chunks 0..2P-1-src) and its first
    # chunk's (chunks 0..src) reach each chunk's owner exactly once
    for world in (1, 2, 3, 8):
        owner = {c: r for r in range(world) for c in cp._chunks(r, world)}
        for src in range(world):
            for late, reach in ((True, 2 * world - src), (False, src + 1)):
                sent = [(c, d) for d in range(world) for c in cp._exchange_chunks(src, d, world, late)]
                assert sorted(sent) == [(c, owner[c]) for c in range(reach)], (world, src, late)


def test_needs_a_process_group():
    from nsa import distributed as cp
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="process group"):
        cp.native_sparse_attention(q, q[:, :, :1], q[:, :, :1], None, torch.ones(1, 4, 2), None, seq_len=4)


def _eval_main(rank, world, port, errors_path):
    """Under torch.no_grad the call returns the same rows and keeps no graph."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from nsa import distributed as cp
    bad = []
    try:
        cfg = nsa.Config(**CONFIG)
        x = _case_inputs(9, 1, 211, 4, 2, 16, 16, 7)
        names = ["q", "k", "v", "g_cmp", "g_slc", "g_swa"]
        whole = nsa.native_sparse_attention(*[x[n] for n in names], config=cfg)
        part = [cp.shard(x[n], rank, world).requires_grad_(True) for n in names]
        with torch.no_grad():
            o = cp.native_sparse_attention(*part, config=cfg, seq_len=211)
        if o.requires_grad or o.grad_fn is not None:
            bad.append("a no_grad call built a graph")
        if not torch.equal(o, cp.shard(whole, rank, world)):
            bad.append("no_grad rows differ from the whole call's")
    except Exception as e:
        bad.append("%s: %s" % (type(e).__name__, e))
    finally:
        dist.destroy_process_group()
    with open("%s.%d" % (errors_path, rank), "w") as f:
        f.write("\n".join(bad))


def test_context_parallel_without_gradients(tmp_path):
    errors = str(tmp_path / "errors")
    mp.spawn(_eval_main, args=(2, _free_port(), errors), nprocs=2, join=True)
    report = [open("%s.%d" % (errors, r)).read().strip() for r in range(2)]
    assert not any(report), report
