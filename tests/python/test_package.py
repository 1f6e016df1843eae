"""Packaging: the stdlib-only build backend makes a wheel holding the package and libnsa.so,
and `pip install .` works with no package index (offline)."""
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT


def _backend():
    spec = importlib.util.spec_from_file_location("_nsa_build_backend",
                                                  os.path.join(ROOT, "python", "nsa", "_build_backend.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# The wheels here are CPU-only (the CUDA units would add minutes to every run of the suite;
# the device script builds and loads the CUDA library the same way).
CPU_ONLY = "NSA_CUDA=0"


def _build_wheel(be, directory):
    old = os.environ.get("NSA_MAKE_ARGS")
    os.environ["NSA_MAKE_ARGS"] = CPU_ONLY
    try:
        return be.build_wheel(directory)
    finally:
        if old is None:
            os.environ.pop("NSA_MAKE_ARGS")
        else:
            os.environ["NSA_MAKE_ARGS"] = old


def _import_from(path, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(path), NSA_NO_TORCH="1")
    env.pop("NSA_LIBRARY", None)
    code = "import nsa, numpy as np; print(nsa._lib.library_path); print(nsa.version())"
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_wheel_contents(tmp_path):
    be = _backend()
    assert be.get_requires_for_build_wheel() == []
    name = _build_wheel(be, str(tmp_path))
    assert name.startswith("nsa-%s-py3-none-" % be._version())
    with zipfile.ZipFile(tmp_path / name) as z:
        names = set(z.namelist())
        assert {"nsa/__init__.py", "nsa/_lib.py", "nsa/_core.py", "nsa/_torch.py", "nsa/nn.py",
                "nsa/libnsa.so"} <= names
        assert "nsa/_build_backend.py" not in names
        record = z.read("nsa-%s.dist-info/RECORD" % be._version()).decode()
        assert "nsa/libnsa.so,sha256=" in record
        z.extractall(tmp_path / "site")
    lib, version = _import_from(tmp_path / "site", tmp_path)
    assert lib == str(tmp_path / "site" / "nsa" / "libnsa.so")  # the copy next to the package
    assert version == be._version()


def test_sdist(tmp_path):
    be = _backend()
    name = be.build_sdist(str(tmp_path))
    import tarfile
    with tarfile.open(tmp_path / name) as t:
        names = t.getnames()
    base = name[:-len(".tar.gz")]
    for must in ("Makefile", "pyproject.toml", "include/nsa.h", "python/nsa/__init__.py", "PKG-INFO"):
        assert base + "/" + must in names, must
    assert not any(n.endswith(".so") for n in names)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_pip_install_offline(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if r.returncode != 0:
        pytest.skip("pip is not available")
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", NSA_MAKE_ARGS=CPU_ONLY)
    target = tmp_path / "target"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), ROOT],
                       env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lib, _ = _import_from(target, tmp_path)
    assert lib == str(target / "nsa" / "libnsa.so")


def test_metadata_matches_pyproject(tmp_path):
    """The wheel's METADATA says what pyproject.toml's [project] table says (the backend writes
    it from its own constants), carries the license, and the package has py.typed and
    __version__."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    be = _backend()
    meta = be._metadata(be._version())
    assert "Name: %s\n" % project["name"] in meta
    assert "License: %s\n" % project["license"]["text"] in meta
    assert "Requires-Python: %s\n" % project["requires-python"] in meta
    for dep in project["dependencies"]:
        assert "Requires-Dist: %s\n" % dep in meta
    for extra, reqs in project["optional-dependencies"].items():
        assert "Provides-Extra: %s\n" % extra in meta
        for r in reqs:
            assert 'Requires-Dist: %s; extra == "%s"' % (r, extra) in meta
    assert project["dynamic"] == ["version"] and os.path.exists(os.path.join(ROOT, "python", "nsa", "py.typed"))
    import nsa
    assert nsa.__version__ == be._version()


def test_portable_wheel_in_its_own_folder(tmp_path):
    """A wheel's library is built with NATIVE=0 in build/wheel (the development build/ is left
    as it is); CPU only here to keep the test short."""
    be = _backend()
    name = _build_wheel(be, str(tmp_path))
    with open(os.path.join(ROOT, "build", "wheel", "config.stamp")) as f:
        stamp = f.read()
    assert "-march=native" not in stamp and "cuda=0" in stamp
    with zipfile.ZipFile(tmp_path / name) as z:
        names = set(z.namelist())
    assert {"nsa/py.typed", "nsa-%s.dist-info/LICENSE" % be._version(), "nsa/libnsa.so"} <= names


def test_wheel_in_a_fresh_venv(tmp_path):
    """The wheel installed into a new virtual environment (this interpreter's packages visible
    for numpy / torch, the index off) and used from outside the repository: a numpy call, and a
    torch call when torch is there."""
    import venv
    be = _backend()
    wheel = tmp_path / _build_wheel(be, str(tmp_path))
    env_dir = tmp_path / "venv"
    try:
        venv.create(env_dir, system_site_packages=True, with_pip=True)
    except Exception as e:  # (a Python without ensurepip)
        pytest.skip("cannot create a venv with pip: %s" % e)
    py = env_dir / "bin" / "python"
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("NSA_LIBRARY", None)
    env.pop("PYTHONPATH", None)
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", str(wheel)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    code = ("import numpy as np, nsa\n"
            "q = np.random.default_rng(0).standard_normal((1, 8, 2, 16)).astype(np.float32)\n"
            "r = nsa.attention(q, q[:, :, :1], q[:, :, :1], causal=True)\n"
            "assert r.o.shape == (1, 8, 2, 16) and np.isfinite(r.o).all()\n"
            "print(nsa.__version__, nsa._lib.library_path)\n"
            "try:\n    import torch\nexcept ImportError:\n    torch = None\n"
            "if torch is not None:\n"
            "    t = torch.from_numpy(q)\n"
            "    o = nsa.attention(t, t[:, :, :1], t[:, :, :1], causal=True).o\n"
            "    assert o.shape == (1, 8, 2, 16)\n")
    r = subprocess.run([str(py), "-c", code], env=env, cwd=str(tmp_path), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    version, lib = r.stdout.split()
    assert version == be._version() and lib.startswith(str(env_dir))


def test_public_functions_have_type_hints():
    """Every public function of nsa carries annotations that resolve (py.typed promises them)."""
    import inspect
    import typing

    import nsa
    for name in nsa.__all__:
        obj = getattr(nsa, name)
        if inspect.isfunction(obj) and name not in ("status_string", "status_name", "cmp_offsets"):
            hints = typing.get_type_hints(obj)
            assert "return" in hints, name
