"""fla's own NSA test file (tests/ops/test_nsa.py of fla-org/flash-linear-attention) run against
nsa.parallel_nsa: a pytest subprocess with the plugin fla_swap/nsa_fla_swap.py, which rebinds
the test module's parallel_nsa to nsa's and leaves fla's naive references and assert_close as
the judge. Every case that calls parallel_nsa must pass, except the known gaps listed in the
plugin (none today), which are strict xfails that must fail the documented way, at the
documented call.

Needs torch with CUDA, libnsa's CUDA backend, triton, and a fla checkout holding
tests/ops/test_nsa.py at $NSA_FLA_ROOT or $NSA_PEERS/fla (default peers/fla; bash
scripts/fetch-peers.sh fla); skips with the reason otherwise. $NSA_FLA_SUMMARY names a file
that receives the per-case table (scripts/device-check.sh reads its last line), and <that file>.log fla's pytest output as it
runs."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from conftest import ROOT, TORCH

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGIN_DIR = os.path.join(HERE, "fla_swap")
sys.path.insert(0, PLUGIN_DIR)
import nsa_fla_swap as swap  # noqa: E402

FLA_TEST = os.path.join("tests", "ops", "test_nsa.py")
# fla's reference computes its window branch with flash-attn; where that is not installed, a
# transcription of its two calls in torch (fla_swap/flash_attn_sdpa) stands in, said in the summary
STAND_IN_DIR = os.path.join(PLUGIN_DIR, "flash_attn_sdpa")


def window_judge():
    """(extra PYTHONPATH entries, the summary's words) for fla's window reference."""
    spec = importlib.util.find_spec("flash_attn")
    if spec is not None:
        return [], "flash-attn (%s)" % os.path.dirname(spec.origin or "")
    return [STAND_IN_DIR], "the torch stand-in for flash-attn (tests/python/fla_swap/flash_attn_sdpa): flash-attn is not installed"


def fla_root():
    if os.environ.get("NSA_FLA_ROOT"):
        return os.path.abspath(os.environ["NSA_FLA_ROOT"])
    return os.path.abspath(os.path.join(os.environ.get("NSA_PEERS") or os.path.join(ROOT, "peers"), "fla"))


def _cuda_ok():
    if TORCH is None:
        return "torch is not installed"
    if not TORCH.cuda.is_available():
        return "no CUDA device"
    import nsa
    if not nsa.backend_available("cuda"):
        return "libnsa.so built without the CUDA backend"
    return None


def _why_skip():
    why = _cuda_ok()
    if why:
        return why
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (fla needs it)"
    if not os.path.isfile(os.path.join(fla_root(), FLA_TEST)):
        return ("no fla checkout with %s at %s (set NSA_FLA_ROOT, or bash scripts/fetch-peers.sh fla)"
                % (FLA_TEST, fla_root()))
    return None


def run_fla(root, timeout=1500, log=None):
    """fla's test file under the swap plugin; (the plugin's JSON report or None, output).
    log: where the output goes as it runs, so a run stopped by a time limit shows how far it got."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        ini = os.path.join(tmp, "pytest.ini")
        with open(ini, "w") as f:  # neither nsa's nor any other pytest configuration applies
            f.write("[pytest]\n")
        env = dict(os.environ, NSA_FLA_REPORT=report, PYTHONPATH=os.pathsep.join(
            [PLUGIN_DIR, root, os.path.join(ROOT, "python")] + window_judge()[0] +
            [p for p in [os.environ.get("PYTHONPATH")] if p]))
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfEsxX", "-p", "nsa_fla_swap", "-p", "no:cacheprovider",
               "-c", ini, "--rootdir", root, "--confcutdir", root, os.path.join(root, FLA_TEST)]
        log = log or os.path.join(tmp, "out.log")
        with open(log, "w") as f:
            subprocess.run(cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        with open(log) as f:
            out = f.read()
        if not os.path.exists(report):
            return None, out
        with open(report) as f:
            return json.load(f), out


def judge(case):
    """(verdict, detail): verdict 'pass', 'xfail' or 'skip' is acceptable, 'FAIL' is not."""
    calls, gap = case.get("calls", []), case.get("gap")
    outcome = case["outcome"]
    if outcome == "skipped":
        return "skip", case["message"]
    if outcome == "failed":
        return "FAIL", case["message"]
    if outcome == "passed":
        if gap:  # strict xfail turns this into 'failed'; kept so a changed plugin cannot hide it
            return "FAIL", "passed but listed as the known gap %r" % gap
        if not calls:
            return "FAIL", "passed without any call reaching nsa.parallel_nsa"
        if not all(c["ok"] for c in calls):
            return "FAIL", "passed although an nsa call raised: %r" % [c for c in calls if not c["ok"]][0]
        return "pass", "%d nsa call(s)" % len(calls)
    # xfailed: the documented exception, from the documented call, every earlier call returned
    spec = swap.GAPS[gap]
    bad = [i for i, c in enumerate(calls) if not c["ok"]]
    if not bad:
        return "FAIL", "xfailed, but no nsa call raised: %s" % case["message"]
    first = calls[bad[0]]
    if bad[0] != spec["call"] or first["exc"] != spec["exc"] or not re.search(spec["match"], first["msg"]):
        return "FAIL", "xfailed the wrong way: nsa call %d raised %s: %s (expected call %d to raise %s matching %r)" % (
            bad[0], first["exc"], first["msg"], spec["call"], spec["exc"], spec["match"])
    return "xfail", "%s; nsa call %d raised %s: %s" % (gap, bad[0], first["exc"], first["msg"])


def table(report):
    rows, counts = [], {"pass": 0, "xfail": 0, "skip": 0, "FAIL": 0}
    for case in report["cases"]:
        verdict, detail = judge(case)
        counts[verdict] += 1
        rows.append("%-5s %s -- %s" % (verdict, case["name"], detail))
    lines = ["swapped: %s" % ", ".join(report["swapped"]),
             "not run (do not call parallel_nsa): %d fla cases" % len(report["deselected"])]
    lines += ["known gap not collected (fla changed?): %s" % n for n in report["stale_gaps"]]
    lines += rows
    lines.append("fla cases: %d passed, %d xfailed, %d skipped, %d failed" % (
        counts["pass"], counts["xfail"], counts["skip"], counts["FAIL"]))
    return lines, counts


@pytest.fixture(scope="module")
def fla_report():
    why = _why_skip()
    if why:
        pytest.skip(why)
    root = fla_root()
    summary = os.environ.get("NSA_FLA_SUMMARY")
    report, out = run_fla(root, log=summary + ".log" if summary else None)
    commit = ""
    if os.path.exists(os.path.join(root, "PEER_COMMIT")):
        with open(os.path.join(root, "PEER_COMMIT")) as f:
            commit = f.read().strip()
    return report, out, commit


def test_fla_nsa_suite(fla_report):
    report, out, commit = fla_report
    assert report is not None, "fla's pytest run left no report:\n" + out[-6000:]
    lines, counts = table(report)
    lines.insert(0, "fla: %s" % (commit or fla_root()))
    lines.insert(1, "window reference: %s" % window_judge()[1])
    text = "\n".join(lines)
    print(text)
    if os.environ.get("NSA_FLA_SUMMARY"):
        with open(os.environ["NSA_FLA_SUMMARY"], "w") as f:
            f.write(text + "\n")
    assert counts["FAIL"] == 0, text + "\n\n" + out[-6000:]
    assert counts["pass"] > 0, "no fla case passed through nsa.parallel_nsa:\n" + text
    # a strict xpass or a collection error shows as a non-zero status with every record fine
    assert report["exitstatus"] == 0, "fla's pytest run exited with %d:\n%s" % (report["exitstatus"], out[-6000:])


def test_decoding_forms_run_on_cuda():
    """fla's decoding call forms (q shorter than k; cu_seqlens=(cu_q, cu_k)) on the GPU at fla's
    dtypes, fla-free: they run and agree with the full-length call's last rows (their
    correctness at every shape is tests/python/test_step.py's and fla's own suite's)."""
    why = _cuda_ok()
    if why:
        pytest.skip(why)
    import nsa
    torch = TORCH
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, Tq, HQ, H, D, S, bs = 1, 96, 5, 16, 1, 64, 4, 32

    def rand(*shape, dtype=torch.float16):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    q, k, v = rand(B, T, HQ, D), rand(B, T, H, D), rand(B, T, H, D)
    gates = [rand(B, T, HQ).sigmoid() for _ in range(3)]
    o = nsa.parallel_nsa(q, k, v, *gates, block_counts=S, block_size=bs, window_size=16)
    dec = nsa.parallel_nsa(q[:, -Tq:], k, v, *[x[:, -Tq:] for x in gates], block_counts=S, block_size=bs, window_size=16)
    assert (dec.float() - o[:, -Tq:].float()).abs().max().item() < 1e-2
    cu_k = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, Tq], dtype=torch.int32, device="cuda")
    dec2 = nsa.parallel_nsa(q[:, -Tq:], k, v, *[x[:, -Tq:] for x in gates], block_counts=S, block_size=bs,
                            window_size=16, cu_seqlens=(cu_q, cu_k))
    assert (dec2.float() - dec.float()).abs().max().item() == 0.0


STAND_IN_TEST = '''
import numpy as np
from fla.ops.nsa.parallel import parallel_nsa, parallel_nsa_fwd


def qkv(T=40):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((1, T, h, 16)).astype(np.float32) for h in (4, 1, 1)]


def test_reaches_nsa():
    o = parallel_nsa(*qkv(), block_counts=3, block_size=16)
    assert o.shape == (1, 40, 4, 16) and np.isfinite(o).all()


def test_tuple_cu_seqlens():
    cu = np.array([0, 40], dtype=np.int32)
    parallel_nsa(*qkv(), block_counts=3, block_size=16, cu_seqlens=(cu, cu))


def test_not_calling():
    parallel_nsa_fwd()
'''


def test_swap_plugin_on_a_stand_in(tmp_path):
    """The plugin's mechanics without torch or fla: a stand-in fla whose parallel_nsa raises,
    a test file importing it by name. The swap must route both calls to nsa (numpy, CPU), drop
    the test that does not call it, and record the raising call; judge() must fail that one."""
    pytest.importorskip("numpy")
    pkg = tmp_path / "fla" / "ops" / "nsa"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "fla", tmp_path / "fla" / "ops", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "parallel.py").write_text(
        "def parallel_nsa(*a, **k):\n    raise AssertionError('the stand-in fla was called')\n\n\n"
        "def parallel_nsa_fwd(*a, **k):\n    raise AssertionError('fla kernel test ran')\n")
    (tmp_path / "tests" / "ops").mkdir(parents=True)
    (tmp_path / FLA_TEST).write_text(STAND_IN_TEST)
    report, out = run_fla(str(tmp_path), timeout=300)
    assert report is not None, out
    assert report["swapped"] == ["test_nsa.parallel_nsa"], out
    assert report["deselected"] == ["test_not_calling"], out
    assert sorted(report["stale_gaps"]) == sorted(swap.KNOWN_GAPS)
    cases = {c["name"]: c for c in report["cases"]}
    assert sorted(cases) == ["test_reaches_nsa", "test_tuple_cu_seqlens"], out
    assert judge(cases["test_reaches_nsa"]) == ("pass", "1 nsa call(s)"), (cases, out)
    bad = cases["test_tuple_cu_seqlens"]
    assert bad["outcome"] == "failed" and bad["calls"] == [
        {"ok": False, "exc": "NotImplementedError", "msg": bad["calls"][0]["msg"]}], (bad, out)
    assert judge(bad)[0] == "FAIL"
    assert report["exitstatus"] == 1


def test_judge_rules(monkeypatch):
    """What the suite accepts: a clean pass, a skip, a gap failing at its call the documented
    way; and what it does not (on made-up gaps: the table of real ones is empty)."""
    monkeypatch.setitem(swap.GAPS, "decode_varlen", {"reason": "r", "exc": "NotImplementedError",
                                                     "match": r"cu_seqlens_q, cu_seqlens_k", "call": 1})
    monkeypatch.setitem(swap.GAPS, "decode", {"reason": "r", "exc": "NsaError", "match": r"\(NSA_STATUS_BAD_SHAPE\)",
                                              "call": 1})
    dec, dcd = "case_a", "case_b"
    ok = {"ok": True}
    tup = {"ok": False, "exc": "NotImplementedError", "msg": "nsa: separate (cu_seqlens_q, cu_seqlens_k) for cached"}
    nsf = {"ok": False, "exc": "NsaError", "msg": "nsa_forward: q: dtype i32, the CUDA kernels take f16, bf16 or f32 "
                                                  "(NSA_STATUS_NOT_SUPPORTED)"}
    dsh = {"ok": False, "exc": "NsaError", "msg": "nsa_forward: q: T 5 against k's 96 (NSA_STATUS_BAD_SHAPE)"}

    def case(name, outcome, calls, gap=None, message=""):
        return {"name": name, "outcome": outcome, "calls": calls, "gap": gap, "message": message}

    assert judge(case("t", "passed", [ok, ok]))[0] == "pass"
    assert judge(case("t", "skipped", [], message="flash_attn"))[0] == "skip"
    assert judge(case(dec, "xfailed", [ok, tup], "decode_varlen"))[0] == "xfail"
    assert judge(case(dec, "xfailed", [ok, nsf], "decode_varlen"))[0] == "FAIL"  # another error
    assert judge(case("t", "failed", [ok], message="AssertionError: o diff"))[0] == "FAIL"
    assert judge(case("t", "passed", []))[0] == "FAIL"                     # never reached nsa
    assert judge(case(dec, "passed", [ok, ok], "decode_varlen"))[0] == "FAIL"  # a gap closed
    assert judge(case(dec, "xfailed", [tup], "decode_varlen"))[0] == "FAIL"    # the full half never ran
    assert judge(case(dcd, "xfailed", [ok, dsh], "decode"))[0] == "xfail"
    assert judge(case(dcd, "xfailed", [dsh], "decode"))[0] == "FAIL"  # the full-length half never ran
    assert judge(case(dcd, "xfailed", [ok], "decode", "AssertionError"))[0] == "FAIL"  # nothing raised


@pytest.mark.skipif(TORCH is None, reason="torch is not installed")
def test_flash_attn_stand_in():
    """The stand-in against torch's scaled_dot_product_attention given the mask written out from
    flash-attn's documentation: a causal window aligned bottom-right with fewer queries than
    keys, grouped heads, the default scale, a packed batch, and a row that sees no key."""
    torch = TORCH
    sys.path.insert(0, STAND_IN_DIR)
    try:
        import flash_attn as stand_in
    finally:
        sys.path.remove(STAND_IN_DIR)
    if getattr(stand_in, "__version__", "") != "0+sdpa-stand-in":
        pytest.skip("a real flash-attn is installed; the stand-in is not used")
    g = torch.Generator().manual_seed(3)
    B, Tq, Tk, HQ, H, D, left = 2, 5, 9, 4, 2, 16, 3
    q, k, v = (torch.randn(B, t, h, D, generator=g, dtype=torch.float64) for t, h in ((Tq, HQ), (Tk, H), (Tk, H)))
    got = stand_in.flash_attn_func(q, k, v, causal=True, window_size=(left, 0))
    i = torch.arange(Tq)[:, None] + (Tk - Tq)
    j = torch.arange(Tk)[None, :]
    mask = (j <= i) & (j >= i - left)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2),
        attn_mask=mask).transpose(1, 2)
    assert torch.allclose(got.double(), want, atol=1e-5)
    # packed: two sequences of 3 and 4 queries (and keys), the second with a window of 0 keys left
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    qp, kp, vp = (torch.randn(7, h, D, generator=g, dtype=torch.float64) for h in (HQ, H, H))
    out = stand_in.flash_attn_varlen_func(qp, kp, vp, cu, cu, 4, 4, causal=True, window_size=(1, 0))
    for a, b in ((0, 3), (3, 7)):
        one = stand_in.flash_attn_func(qp[None, a:b], kp[None, a:b], vp[None, a:b], causal=True, window_size=(1, 0))
        assert torch.equal(out[a:b], one[0])
    # Tq > Tk aligned bottom-right: the first query's diagonal key is -1, so it sees nothing
    none = stand_in.flash_attn_func(q[:, :3], k[:, :2], v[:, :2], causal=True)
    assert torch.equal(none[:, 0], torch.zeros_like(none[:, 0]))
