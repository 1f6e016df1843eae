"""bench/peers.py (the side-by-side GPU harness) keeps its pure parts working here:
FLOP counts, rows, ratios, the table, the JSON round trip (and the PNG when matplotlib is
installed), through its own --self-test. The GPU parts run only on a GPU machine."""
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_peers_harness_self_test():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers.py"), "--self-test"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 failed" in r.stdout, r.stdout


def test_decode_bench_self_test():
    """bench/decode.py's byte floors (the decode targets' figures), rows, table and JSON."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "decode.py"), "--self-test"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 failed" in r.stdout, r.stdout


def test_decode_bench_runs_on_the_cpu(tmp_path):
    """The timed path end to end on the CPU backend (nsa rows; the GPU peers skip with a reason)."""
    import pytest
    pytest.importorskip("torch", reason="torch is not installed")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "decode.py"), "--device", "cpu", "--batch", "2",
                        "--ctx", "300", "--impl", "nsa,mdy666", "--reps", "2", "--warmup", "1", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    rows = json.load(open(next(tmp_path.glob("*-decode.json"))))
    assert {(x["impl"], x["op"]) for x in rows} == {("nsa", "nsa"), ("nsa", "dense")}
    assert all(x["us"] > 0 and x["floor_us"] > 0 and x["B"] == 2 and x["ctx"] == 300 for x in rows)
    assert "mdy666 nsa B=2 ctx=300: mdy666 runs on CUDA only" in r.stdout


def test_flex_bench_self_test():
    """bench/flex.py's visible-pair counts (against a brute force), rows, table and JSON."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "flex.py"), "--self-test"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 failed" in r.stdout, r.stdout


def test_flex_bench_runs_on_the_cpu(tmp_path):
    """The timed path end to end on the CPU backend (nsa rows, forward and backward)."""
    import pytest
    pytest.importorskip("torch", reason="torch is not installed")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "flex.py"), "--device", "cpu", "--T", "200",
                        "--heads", "4/2", "--impl", "nsa", "--mods", "causal,alibi", "--reps", "1", "--warmup", "0",
                        "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    rows = json.load(open(next(tmp_path.glob("*-flex.json"))))
    assert {(x["mod"], x["pass"]) for x in rows} == {("causal", "fwd"), ("causal", "fwd+bwd"), ("alibi", "fwd"),
                                                     ("alibi", "fwd+bwd")}
    assert all(x["ms"] > 0 and x["T"] == 200 for x in rows)
