"""bench/overlap.py: the neighbour-overlap metric (mean Jaccard of neighbouring positions' selected
blocks) on hand-made sets, and its runs on random inputs and on a saved workload file."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "overlap.py")


def _run(*args):
    r = subprocess.run([sys.executable, SCRIPT] + list(args), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_metric_self_test():
    assert "11 passed, 0 failed" in _run("--self-test")


def test_random_and_saved_inputs(tmp_path):
    # 3000 tokens: 47 blocks, more than the 16 a query takes (below 16 every query takes all it sees)
    out = _run("--T", "3000", "--heads", "4/2", "--dim", "16", "--json", str(tmp_path / "r.json"))
    mean = float(out.split("mean Jaccard) ")[1].split()[0])
    assert 0.0 <= mean < 0.9 and "over 5998 pairs" in out  # (T - 1) positions x H kv heads
    with open(tmp_path / "r.json") as f:
        fig = json.load(f)
    # at most 16 blocks a position (fewer early on); a tile of P loads at least one set's worth
    # of blocks and at most P sets
    for P, t in ((8, fig["tiles"]["8"]), (16, fig["tiles"]["16"])):
        assert 1.0 <= t["set_per_position"] <= 16.0 and 1.0 / P <= t["bytes_ratio"] <= 1.0
        # each position runs every block of its tile's union (a last partial tile: fewer positions)
        assert 1.0 <= t["products_ratio"] <= P * t["bytes_ratio"] + 1e-9 and "query tiles of %2d" % P in out
    # a saved layer whose queries repeat the previous position's: every neighbour selects alike
    rng = np.random.default_rng(1)
    q = np.repeat(rng.standard_normal((1, 1, 4, 16)), 3000, axis=1).astype(np.float32)
    k = rng.standard_normal((1, 3000, 2, 16)).astype(np.float32)
    np.savez(tmp_path / "layer.npz", q=q, k=k)
    out = _run("--workload", str(tmp_path / "layer.npz"))
    assert "workload layer.npz" in out
    same_q = float(out.split("mean Jaccard) ")[1].split()[0])
    assert same_q > 0.95 > mean  # the same query everywhere: neighbours select alike


def test_workload_written_and_read(tmp_path):
    """bench/workload.py on the CPU (train_tiny's tiny model, trained for a few steps): the .npz
    holds one layer's NSA inputs and config, its .json the overlap; bench/overlap.py reads it."""
    pytest.importorskip("torch")
    out = tmp_path / "w.npz"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "workload.py"), "--tiny", "--train-steps", "3", "--T",
                        "300", "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python")))
    assert r.returncode == 0, r.stdout + r.stderr
    data = np.load(out)
    assert data["q"].shape[:2] == (1, 300) and data["k_cmp"].shape[1] > 0 and len(data["config"]) == 7
    assert {"g_cmp", "g_slc", "g_swa", "v", "v_cmp"} <= set(data.files)
    assert "workload w.npz" in _run("--workload", str(out))
    with open(tmp_path / "w.json") as f:
        meta = json.load(f)
    assert 0.0 <= meta["neighbour_overlap"] <= 1.0 and meta["layer"] == 0 and meta["T"] == 300
    for key in ("tiles", "tiles_random"):
        assert set(meta[key]) == {"8", "16"} and all(0.0 < t["bytes_ratio"] <= 1.0 for t in meta[key].values())


def test_workload_of_a_paper_config_model(tmp_path):
    """train_tiny --nsa-config paper saves a model whose layers run the paper's NSA
    configuration; bench/workload.py records it, so bench/peers.py --workload times that."""
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    ck = tmp_path / "paper.pt"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_tiny.py"), "--tiny", "--nsa-config", "paper",
                        "--steps", "2", "--eval-every", "2", "--device", "cpu", "--out", str(tmp_path), "--save", str(ck)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    out = tmp_path / "w.npz"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "workload.py"), "--checkpoint", str(ck), "--T", "300",
                        "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    # the paper's cmp_len, cmp_stride, slc_block, slc_topk, n_init, n_local; the window cut to --tiny's 128 tokens
    assert list(np.load(out)["config"]) == [32, 16, 64, 16, 1, 2, 128]
