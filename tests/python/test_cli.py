"""The CLI's bench op selection (build/nsa bench --op): the listed ops are timed and written to
the JSON, what they read runs first untimed, unknown names are a usage error (exit 2); and the
table of bench --branches."""
import json
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(ROOT, "build", "nsa")
SMALL = ["--backend", "cpu", "--T", "256", "--HQ", "2", "--H", "1", "--D", "16", "--reps", "1", "--threads", "1"]


def bench(tmp_path, *extra):
    if not os.path.exists(CLI):
        pytest.skip("build/nsa not built")
    out = tmp_path / "bench.json"
    r = subprocess.run([CLI, "bench", *SMALL, "--json", str(out), *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text()), r


def test_op_attention_times_window_and_dense_both_passes(tmp_path):
    rows, r = bench(tmp_path, "--op", "attention")
    assert sorted(x["op"] for x in rows) == ["dense", "dense_bwd", "window", "window_bwd"]
    for x in rows:
        assert x["ms"] > 0 and x["gflops"] > 0 and x["backend"] == "cpu"
        assert x["pass"] == ("bwd" if x["op"].endswith("_bwd") else "fwd")
        assert x["impl"] == ("dense" if x["op"].startswith("dense") else "nsa")


def test_op_runs_its_inputs_untimed(tmp_path):
    rows, r = bench(tmp_path, "--op", "slc_attn")
    assert [x["op"] for x in rows] == ["slc_attn"]
    assert "nsa_select (input of a timed op, untimed)" in r.stderr


def test_op_decode_times_one_inference_step(tmp_path):
    rows, r = bench(tmp_path, "--op", "decode")
    assert [x["op"] for x in rows] == ["decode"] and rows[0]["ms"] > 0 and rows[0]["gflops"] > 0
    assert "nsa_compress (k and v) (input of a timed op, untimed)" in r.stderr


def test_unknown_op_is_a_usage_error(tmp_path):
    if not os.path.exists(CLI):
        pytest.skip("build/nsa not built")
    r = subprocess.run([CLI, "bench", *SMALL, "--op", "bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown op 'bogus'" in r.stderr


def test_branches_table(tmp_path):
    """bench --branches keeps the table of the former nsa_gpu_bench (scripts read it): a header
    line, the column line, then per length T, fwd, bwd, three branch forwards, three branch
    backwards (ms) and the workspace size."""
    if not os.path.exists(CLI):
        pytest.skip("build/nsa not built")
    r = subprocess.run([CLI, "bench", "--branches", "--backend", "cpu", "--T", "64,128", "--HQ", "2", "--H", "1",
                        "--D", "16", "--reps", "1", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("gpu_bench: cpu (1 threads), bf16, HQ=2 H=1 DK=16 DV=16, config paper (l=32 d=16")
    assert lines[0].endswith("median of 1")
    assert lines[1].split() == ["T", "fwd", "bwd", "|", "fwd_cmp", "fwd_slc", "fwd_swa", "|", "bwd_cmp", "bwd_slc",
                                "bwd_swa", "(ms)"]
    rows = [l.split() for l in lines[2:]]
    assert [x[0] for x in rows] == ["64", "128"]
    for x in rows:
        assert x[3] == "|" and x[7] == "|" and x[11] == "ws" and x[13] == "GB"
        assert all(float(v) > 0 for v in x[1:3] + x[4:7] + x[8:11])


def test_branches_unknown_option_is_a_usage_error():
    if not os.path.exists(CLI):
        pytest.skip("build/nsa not built")
    r = subprocess.run([CLI, "bench", "--branches", "--json", "x.json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bench --branches: unknown option '--json'" in r.stderr


def test_library_failure_prints_its_detail():
    """A failing library status prints the detail (the argument at fault), not only the status string."""
    if not os.path.exists(CLI):
        pytest.skip("build/nsa not built")
    import nsa
    if nsa.backend_available("cuda"):
        pytest.skip("needs a machine where the CUDA backend is absent")
    r = subprocess.run([CLI, "demo", "--backend", "cuda"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "cuda: desc.backend: " in r.stderr and "status 16" in r.stderr, r.stderr


def _cli(*args):
    if not os.path.exists(CLI):
        pytest.skip("build/nsa not built")
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("cmd,flags", [
    ("demo", ["--backend", "--T", "--threads", "--seed", "--rows", "--no-dense"]),
    ("check", ["--seed", "--minutes", "--cases", "--backend", "--threads", "-v", "--op", "--hash-out", "--hash-cmp",
               "--variant", "--nonfinite"]),
    ("bench", ["--T", "--config", "--HQ", "--H", "--D", "--DK", "--DV", "--dtype", "--threads", "--backend", "--reps",
               "--no-dense", "--bwd", "--json", "--op", "--branches", "--profile", "--f16"]),
])
def test_command_help_is_its_own(cmd, flags):
    """`nsa <command> --help` prints that command's help (every flag it takes), not the others'."""
    r = _cli(cmd, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: nsa %s [options]" % cmd)
    listed = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", r.stdout))
    assert set(flags) <= listed, set(flags) - listed
    others = {"demo", "check", "bench", "version"} - {cmd}
    assert not any("  nsa %s " % o in r.stdout for o in others)
    assert _cli("help", cmd).stdout == r.stdout


def test_check_cases_zero_is_a_usage_error():
    """`check --cases 0` is refused at once (it used to run the default minute)."""
    r = _cli("check", "--cases", "0")
    assert r.returncode == 2
    assert "--cases: expected an integer in [1," in r.stderr


def test_demo_small_cpu():
    """demo on a small CPU shape: the branch table, the whole passes, the speed-up line, and the
    accuracy check (exit code 0)."""
    r = _cli("demo", "--backend", "cpu", "--T", "300", "--HQ", "4", "--H", "2", "--threads", "1", "--reps", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "shape   B=1 T=300 HQ=4 H=2" in out and "times: median of 3 calls" in out
    for line in ("compressed attention", "NSA forward", "NSA backward", "dense causal forward"):
        assert line in out, line
    assert re.search(r"speed-up of the NSA forward over dense causal attention at T = 300: [0-9.]+x", out)
    assert re.search(r"accuracy: .*\n.*: ok", out)
