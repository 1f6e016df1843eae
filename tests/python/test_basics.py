"""Loading, versions, status strings, errors, Config, helpers; no numpy needed except where said."""
import ctypes
import os
import shutil
import subprocess
import sys

import pytest

import nsa
from nsa import _lib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_version():
    v = nsa.version()
    assert v.count(".") == 2
    major, minor, patch = (int(x) for x in v.split("."))
    assert nsa.library.nsa_version_number() == major * 10000 + minor * 100 + patch


def test_status_strings():
    for code, name in enumerate(_lib.STATUS_NAMES):
        s = nsa.status_string(code)
        assert s and s != "unknown status", name
        assert nsa.status_name(code) == name
    assert nsa.status_string(0) == "success"
    assert nsa.status_string(999) == "unknown status"


def test_error_carries_status_string():
    e = nsa.NsaError(_lib.STATUS_BAD_GQA, op="forward")
    assert isinstance(e, RuntimeError)
    assert e.status == 6 and e.name == "BAD_GQA"
    assert nsa.status_string(6) in str(e) and "nsa_forward" in str(e) and "NSA_STATUS_BAD_GQA" in str(e)


def test_backends():
    assert nsa.backend_available("cpu")
    assert nsa.backend_available("cuda") in (True, False)
    with pytest.raises(ValueError):
        nsa.backend_available("tpu")


def test_config_defaults_match_c():
    c = nsa.library.nsa_config_default()
    py = nsa.Config().to_c()
    for f, _ in _lib.Config._fields_:
        assert getattr(c, f) == getattr(py, f), f
    assert nsa.Config().validate() == nsa.Config()


@pytest.mark.parametrize("kw, status", [
    (dict(cmp_stride=0), "BAD_CMP_STRIDE"),
    (dict(cmp_len=24), "BAD_CMP_STRIDE"),       # d = 16 does not divide l = 24
    (dict(cmp_len=128), "BAD_CMP_LEN"),         # l > l'
    (dict(slc_block=72), "BAD_SLC_BLOCK"),      # d = 16 does not divide l' = 72
    (dict(slc_topk=2), "BAD_TOPK"),             # n < n_init + n_local
    (dict(window=0), "BAD_WINDOW"),
    (dict(scale=-1.0), "BAD_SCALE"),
    (dict(scale=float("nan")), "BAD_SCALE"),
])
def test_config_validate(kw, status):
    with pytest.raises(nsa.NsaError) as e:
        nsa.Config(**kw).validate()
    assert e.value.name == status


def test_config_error_names_the_field():
    with pytest.raises(nsa.NsaError) as e:
        nsa.Config(slc_block=72).validate()
    assert str(e.value) == ("nsa_config_validate: config.slc_block: 72 is not a multiple of cmp_stride 16 "
                            "(NSA_STATUS_BAD_SLC_BLOCK)")
    with pytest.raises(nsa.NsaError) as e:
        nsa.Config(slc_topk=2).validate()
    assert e.value.detail == "config.slc_topk: 2 < n_init 1 + n_local 2"


def test_config_fla():
    c = nsa.Config.fla(block_size=64, block_counts=16, window_size=512)
    assert (c.cmp_len, c.cmp_stride, c.slc_block, c.slc_topk, c.window) == (64, 64, 64, 16, 512)
    assert (c.n_init, c.n_local, c.scale) == (1, 2, 0.0)
    assert nsa.Config.fla(window_size=0).window >= 1  # unused (branch off) but valid


def test_block_counts_helpers():
    c = nsa.Config()  # l=32 d=16 l'=64
    assert [c.num_cmp_blocks(T) for T in (0, 31, 32, 47, 48, 100)] == [0, 0, 1, 1, 2, 5]
    assert [c.num_slc_blocks(T) for T in (0, 1, 64, 65)] == [0, 1, 1, 2]
    assert nsa.cmp_offsets(c, [0, 31, 63, 163, 163]) == [0, 0, 1, 6, 6]  # lengths 31, 32, 100, 0
    with pytest.raises(nsa.NsaError) as e:
        nsa.cmp_offsets(c, [0, 10, 5])
    assert e.value.name == "BAD_CU_SEQLENS"
    assert e.value.detail == "cu_seqlens: cu_seqlens[2] = 5 < cu_seqlens[1] = 10 (must not decrease)"


def _run(code, env=None, cwd=None):
    e = dict(os.environ)
    e.pop("NSA_LIBRARY", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], env=e, cwd=cwd, capture_output=True, text=True)


def test_import_from_repo():
    """PYTHONPATH=python python3 -c 'import nsa' works after make (library from build/)."""
    r = _run("import nsa; print(nsa._lib.library_path)",
             env={"PYTHONPATH": os.path.join(ROOT, "python"), "NSA_NO_TORCH": "1"}, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    if not os.path.exists(os.path.join(ROOT, "python", "nsa", "libnsa.so")):
        assert r.stdout.strip() == os.path.join(ROOT, "build", "libnsa.so")


def test_nsa_library_env(tmp_path):
    lib = tmp_path / "libnsa_copy.so"
    shutil.copy(nsa._lib.library_path, lib)
    r = _run("import nsa; print(nsa._lib.library_path, nsa.version())",
             env={"PYTHONPATH": os.path.join(ROOT, "python"), "NSA_LIBRARY": str(lib), "NSA_NO_TORCH": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == str(lib)


def test_nsa_library_missing_file(tmp_path):
    """NSA_LIBRARY naming a file that is not there is an error, not a silent fallback."""
    missing = tmp_path / "no_such_libnsa.so"
    r = _run("import nsa", env={"PYTHONPATH": os.path.join(ROOT, "python"), "NSA_LIBRARY": str(missing),
                                "NSA_NO_TORCH": "1"})
    assert r.returncode != 0
    assert "NSA_LIBRARY names %s, which does not exist" % missing in r.stderr


def test_missing_library_message(tmp_path):
    pkg = tmp_path / "nsa"
    shutil.copytree(os.path.join(ROOT, "python", "nsa"), pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    r = _run("import nsa", env={"PYTHONPATH": str(tmp_path), "NSA_NO_TORCH": "1"}, cwd=str(tmp_path))
    assert r.returncode != 0
    assert "libnsa.so not found" in r.stderr


def test_import_does_not_need_numpy_or_torch():
    r = _run("import sys; sys.modules['numpy'] = None; sys.modules['torch'] = None\n"
             "import nsa; print(nsa.version(), nsa.torch_available())",
             env={"PYTHONPATH": os.path.join(ROOT, "python")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[1] == "False"


def test_context_cache():
    from nsa import _core
    a = _core.context(_lib.BACKEND_CPU)
    b = _core.context(_lib.BACKEND_CPU)
    assert a.value == b.value and nsa.library.nsa_context_backend(a) == _lib.BACKEND_CPU
    if not nsa.backend_available("cuda"):
        with pytest.raises(nsa.NsaError) as e:
            _core._Context(_lib.BACKEND_CUDA)
        assert e.value.name == "BACKEND_UNAVAILABLE"
        assert e.value.detail.startswith("desc.backend: ")
    handle = ctypes.c_void_p()
    bad = _lib.ContextDesc(backend=_lib.BACKEND_CPU, num_threads=-1)
    assert nsa.library.nsa_context_create(ctypes.byref(handle), ctypes.byref(bad)) == _lib.STATUS_BAD_ARGUMENT


def test_calls_without_heads_are_empty():
    """HQ = H = 0 (a shard that holds no heads): every op succeeds with empty outputs; a dbias
    broadcast over the heads is the sum over none (zeros); the steps still report per sequence;
    one head count 0 and not the other is refused (BAD_GQA). Needs numpy."""
    np = pytest.importorskip("numpy")
    cfg = nsa.Config(8, 4, 16, 4, 1, 1, 20, 0.3, 0.0)
    B, T, D = 2, 40, 16
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    q = k = v = z(B, T, 0, D)
    g = z(B, T, 0)
    r = nsa.forward(q, k, v, g, g, g, config=cfg)
    assert r.o.shape == (B, T, 0, D)
    grads = r.backward(z(B, T, 0, D))
    assert grads.q.shape == (B, T, 0, D) and grads.k.shape == (B, T, 0, D)
    bias = np.ones((B, 1, T, T), np.float32)
    a = nsa.attention(q, k, v, causal=True, bias=bias)
    assert a.o.shape == (B, T, 0, D) and a.lse.shape == (B, T, 0)
    ag = a.backward(z(B, T, 0, D), dbias=True)
    assert ag.dbias.shape == bias.shape and (ag.dbias == 0).all()
    assert nsa.compress(k, cfg).shape == (B, 9, 0, D)
    o, _, err = nsa.step(q[:, :1], (z(B, 50, 0, D), z(B, 50, 0, D)), np.array([10, 49], np.int32), cfg,
                         k_new=k[:, :1], v_new=v[:, :1], cmp_cache=(z(B, 11, 0, D), z(B, 11, 0, D)), g_cmp=g[:, :1],
                         g_slc=g[:, :1], g_swa=g[:, :1], return_errors=True)
    assert o.shape == (B, 1, 0, D) and (err == 0).all()
    with pytest.raises(nsa.NsaError, match=r"capacity"):  # the step's checks still apply without heads
        nsa.attention_step(q[:, :1], (z(B, 50, 0, D), z(B, 50, 0, D)), np.array([10, 50], np.int32), k_new=k[:, :1],
                           v_new=v[:, :1])
    with pytest.raises(nsa.NsaError, match=r"HQ\) is 0 with H = 2") as e:
        nsa.forward(q, z(B, T, 2, D), z(B, T, 2, D), g, g, g, config=cfg)
    assert e.value.name == "BAD_GQA"
