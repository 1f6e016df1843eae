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
    name = be.build_wheel(str(tmp_path))
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
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    target = tmp_path / "target"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), ROOT],
                       env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lib, _ = _import_from(target, tmp_path)
    assert lib == str(target / "nsa" / "libnsa.so")
