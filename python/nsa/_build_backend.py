"""PEP 517 / 660 build backend of the nsa package, standard library only.

`pip install .` works offline: the backend needs no download (pyproject.toml lists no build
requirement), runs `make B=build/wheel NATIVE=0 build/wheel/libnsa.so` (the C library for any
x86-64 CPU, not just this one, in its own build folder; with the CUDA backend when nvcc is on
PATH: the Makefile's NSA_CUDA=auto) and packs python/nsa/*.py, py.typed, libnsa.so and the
license into a wheel. Extra make arguments: the NSA_MAKE_ARGS environment variable or the
config setting "make-args", e.g. `pip install . --config-settings make-args="NSA_CUDA=0"` for
a CPU-only build, "NATIVE=1" for this CPU's instructions. `pip install -e .` installs a path
to python/ instead, using build/libnsa.so (the development build) in place. Not part of the
installed package.
"""
import base64
import hashlib
import io
import os
import re
import shlex
import subprocess
import sysconfig
import tarfile
import zipfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PKG = os.path.join(ROOT, "python", "nsa")
NAME = "nsa"
SUMMARY = "Native Sparse Attention (DeepSeek, arXiv 2502.11089): a C11 library with a Python binding"


def _version():
    with open(os.path.join(ROOT, "include", "nsa.h")) as f:
        text = f.read()
    parts = [re.search(r"#define NSA_VERSION_%s (\d+)" % p, text).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


def _tag():
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return "py3-none-" + plat


def _make(config_settings, portable=True):
    """make's libnsa.so: for a wheel a portable build in build/wheel, for an editable install
    the development build in build/ (the caller's arguments win either way)."""
    args = ["B=build/wheel", "NATIVE=0"] if portable else []
    args += shlex.split(os.environ.get("NSA_MAKE_ARGS", ""))
    if config_settings and config_settings.get("make-args"):
        args += shlex.split(config_settings["make-args"])
    build = "build"
    for a in args:
        if a.startswith("B="):
            build = a[2:]
    jobs = "-j%d" % (os.cpu_count() or 1)
    print("nsa: building the C library%s in %s (make %s) -- with CUDA this takes minutes"
          % ("" if not portable else " for any x86-64 CPU", build, " ".join(args)), flush=True)
    subprocess.run(["make", "-C", ROOT, jobs] + args + [build + "/libnsa.so"], check=True)
    return os.path.join(ROOT, build, "libnsa.so")


LICENSE = "MIT"
URL = "https://github.com/nsa-authors/nsa"
REQUIRES_PYTHON = ">=3.8"
DEPENDENCIES = ("numpy",)
OPTIONAL = {"torch": ("torch>=2.4",)}


def _metadata(version):
    """Core metadata 2.1, the fields of pyproject.toml's [project] table (a test keeps the two
    equal): name, version (nsa.h), summary, license, URL, Python, numpy, the torch extra."""
    lines = ["Metadata-Version: 2.1", "Name: " + NAME, "Version: " + version, "Summary: " + SUMMARY,
             "License: " + LICENSE, "Home-page: " + URL, "Project-URL: Source, " + URL,
             "Requires-Python: " + REQUIRES_PYTHON]
    lines += ["Requires-Dist: " + d for d in DEPENDENCIES]
    for extra, reqs in OPTIONAL.items():
        lines.append("Provides-Extra: " + extra)
        lines += ['Requires-Dist: %s; extra == "%s"' % (r, extra) for r in reqs]
    return "\n".join(lines) + "\n"


class _Wheel:
    def __init__(self, directory, tag):
        self.version = _version()
        self.name = "%s-%s-%s.whl" % (NAME, self.version, tag)
        self.path = os.path.join(directory, self.name)
        self.dist_info = "%s-%s.dist-info" % (NAME, self.version)
        self.tag = tag
        self.records = []
        self.zf = zipfile.ZipFile(self.path, "w", compression=zipfile.ZIP_DEFLATED)

    def add(self, arcname, data, mode=0o644):
        info = zipfile.ZipInfo(arcname, date_time=(2025, 1, 1, 0, 0, 0))
        info.external_attr = (0o100000 | mode) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        self.zf.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.records.append("%s,sha256=%s,%d" % (arcname, digest, len(data)))

    def close(self):
        self.add(self.dist_info + "/METADATA", _metadata(self.version).encode())
        self.add(self.dist_info + "/WHEEL", ("Wheel-Version: 1.0\nGenerator: nsa-build-backend\nRoot-Is-Purelib: false\n"
                                             "Tag: %s\n" % self.tag).encode())
        self.add(self.dist_info + "/top_level.txt", b"nsa\n")
        with open(os.path.join(ROOT, "LICENSE"), "rb") as f:
            self.add(self.dist_info + "/LICENSE", f.read())
        record = self.dist_info + "/RECORD"
        self.zf.writestr(zipfile.ZipInfo(record, date_time=(2025, 1, 1, 0, 0, 0)),
                         "\n".join(self.records + [record + ",,"]) + "\n")
        self.zf.close()
        return self.name


def _package_files():
    for name in sorted(os.listdir(PKG)):
        if (name.endswith(".py") and name != "_build_backend.py") or name == "py.typed":
            yield name


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    lib = _make(config_settings)
    w = _Wheel(wheel_directory, _tag())
    for name in _package_files():
        with open(os.path.join(PKG, name), "rb") as f:
            w.add("nsa/" + name, f.read())
    with open(lib, "rb") as f:
        w.add("nsa/libnsa.so", f.read(), mode=0o755)
    return w.close()


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _make(config_settings, portable=False)
    w = _Wheel(wheel_directory, _tag())
    w.add("nsa_editable.pth", (os.path.join(ROOT, "python") + "\n").encode())
    return w.close()


def build_sdist(sdist_directory, config_settings=None):
    version = _version()
    base = "%s-%s" % (NAME, version)
    name = base + ".tar.gz"
    keep = ("Makefile", "pyproject.toml", "README.md", "LICENSE", "include", "src", "python", "examples")
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz") as tar:
        for top in keep:
            path = os.path.join(ROOT, top)
            if not os.path.exists(path):
                continue
            tar.add(path, arcname=base + "/" + top,
                    filter=lambda ti: None if ("__pycache__" in ti.name or ti.name.endswith((".so", ".pyc")))
                    else ti)
        data = _metadata(version).encode()
        info = tarfile.TarInfo(base + "/PKG-INFO")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return name
