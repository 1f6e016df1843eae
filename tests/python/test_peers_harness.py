"""The benchmark scripts keep their pure parts working here: bench/peers.py (the side-by-side
GPU harness: FLOP counts, rows, ratios, the table, the JSON round trip and the PNG when
matplotlib is installed), bench/decode.py (byte floors) and bench/flex.py (visible-pair counts)
through their own --self-test; decode.py and flex.py also run their timed paths on the CPU
backend. The GPU parts run only on a GPU machine."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def _run(script, *args, timeout=120):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script)] + list(args), env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.parametrize("script", ["peers.py", "decode.py", "flex.py"])
def test_bench_self_test(script):
    """peers.py's harness, decode.py's byte floors (the decode targets' figures), flex.py's
    visible-pair counts (against a brute force): rows, tables and JSON."""
    out = _run(script, "--self-test")
    assert " 0 failed" in out, out


def test_decode_bench_runs_on_the_cpu(tmp_path):
    """The timed path end to end on the CPU backend (nsa rows; the GPU peers skip with a reason)."""
    pytest.importorskip("torch", reason="torch is not installed")
    out = _run("decode.py", "--device", "cpu", "--batch", "2", "--ctx", "300", "--impl", "nsa,mdy666", "--reps", "2",
               "--warmup", "1", "--out", str(tmp_path), timeout=300)
    with open(next(tmp_path.glob("*-decode.json"))) as f:
        rows = json.load(f)
    assert {(x["impl"], x["op"]) for x in rows} == {("nsa", "nsa"), ("nsa", "dense")}
    assert all(x["us"] > 0 and x["floor_us"] > 0 and x["B"] == 2 and x["ctx"] == 300 for x in rows)
    assert "mdy666 nsa B=2 ctx=300: mdy666 runs on CUDA only" in out


def test_flex_bench_runs_on_the_cpu(tmp_path):
    """The timed path end to end on the CPU backend (nsa rows, forward and backward)."""
    pytest.importorskip("torch", reason="torch is not installed")
    _run("flex.py", "--device", "cpu", "--T", "200", "--heads", "4/2", "--impl", "nsa", "--mods", "causal,alibi", "--reps",
         "1", "--warmup", "0", "--out", str(tmp_path), timeout=600)
    with open(next(tmp_path.glob("*-flex.json"))) as f:
        rows = json.load(f)
    assert {(x["mod"], x["pass"]) for x in rows} == {("causal", "fwd"), ("causal", "fwd+bwd"), ("alibi", "fwd"),
                                                     ("alibi", "fwd+bwd")}
    assert all(x["ms"] > 0 and x["T"] == 200 for x in rows)


def _saved_layer(path, T=512, HQ=8, H=2, D=64, config=(16, 8, 32, 8, 1, 2, 128), drop=()):
    import numpy as np
    rng = np.random.default_rng(0)
    arrays = dict(q=rng.standard_normal((1, T, HQ, D)), k=rng.standard_normal((1, T, H, D)),
                  v=rng.standard_normal((1, T, H, D)), g_cmp=rng.random((1, T, HQ)), g_slc=rng.random((1, T, HQ)),
                  g_swa=rng.random((1, T, HQ)), k_cmp=rng.standard_normal((1, 63, H, D)),
                  v_cmp=rng.standard_normal((1, 63, H, D)), config=np.array(config))
    np.savez(path, **{n: a.astype(np.float16) if n != "config" else a for n, a in arrays.items() if n not in drop})


def test_peers_workload_plan(tmp_path):
    """--workload: nsa and mdy666 at the saved layer's T, heads and NSA configuration (the plan
    and its FLOP counts; the timed run needs a GPU), and a clear error for a file that lacks a
    tensor or has the wrong shapes."""
    _saved_layer(tmp_path / "layer.npz")
    out = _run("peers.py", "--workload", str(tmp_path / "layer.npz"), "--list")
    plan = [line.split() for line in out.splitlines() if " workload " in line]
    assert sorted((p[0], p[1], p[3], p[4], p[5]) for p in plan) == sorted(
        (i, v, "4", "512", p) for i, v in (("nsa", "native"), ("mdy666", "hf+flexswa")) for p in ("fwd", "fwd+bwd"))
    _saved_layer(tmp_path / "short.npz", drop=("k_cmp",))
    _saved_layer(tmp_path / "odd.npz", HQ=6, H=4)
    for name, why in (("short.npz", "lacks k_cmp"), ("odd.npz", "HQ 6 is not a multiple of H 4")):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers.py"), "--workload", str(tmp_path / name),
                            "--list"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and why in r.stderr, r.stderr
