"""The ctypes mirrors in nsa/_lib.py against the C compiler: every struct's size and every
field's offset, and every enum value, printed by a tiny C program compiled against nsa.h."""
import ctypes
import os
import shutil
import subprocess

import pytest

import nsa
from nsa import _lib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CC = os.environ.get("CC", "cc")

ENUMS = ["NSA_STATUS_" + n for n in _lib.STATUS_NAMES] + [
    "NSA_DTYPE_F32", "NSA_DTYPE_F16", "NSA_DTYPE_BF16", "NSA_DTYPE_I32", "NSA_DTYPE_U8",
    "NSA_BACKEND_CPU", "NSA_BACKEND_CUDA", "NSA_MAX_RANK", "NSA_VERSION_NUMBER"]


def _c_program():
    lines = ["#include <stddef.h>", "#include <stdio.h>", "#include <nsa.h>", "int main(void) {"]
    for cname, py in _lib.STRUCTS.items():
        lines.append('    printf("%s %%zu\\n", sizeof(%s));' % (cname, cname))
        for field, _ in py._fields_:
            lines.append('    printf("%s.%s %%zu\\n", offsetof(%s, %s));' % (cname, field, cname, field))
    for e in ENUMS:
        lines.append('    printf("%s %%d\\n", (int)%s);' % (e, e))
    lines += ["    return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    if shutil.which(CC) is None:
        pytest.skip("no C compiler (%s) to print the C layout" % CC)
    d = tmp_path_factory.mktemp("abi")
    src, exe = d / "layout.c", d / "layout"
    src.write_text(_c_program())
    subprocess.run([CC, "-std=c11", "-I", os.path.join(ROOT, "include"), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return dict((k, int(v)) for k, v in (line.split() for line in out.splitlines()))


@pytest.mark.parametrize("cname", sorted(_lib.STRUCTS))
def test_struct_layout(c_layout, cname):
    py = _lib.STRUCTS[cname]
    assert ctypes.sizeof(py) == c_layout[cname], "sizeof(%s)" % cname
    for field, _ in py._fields_:
        assert getattr(py, field).offset == c_layout["%s.%s" % (cname, field)], "offsetof(%s, %s)" % (cname, field)


def test_struct_fields_cover_c(c_layout):
    """Each struct's fields end exactly where the C struct ends (less tail padding): a field
    missing from the mirror would leave a gap the offsets alone do not show."""
    for cname, py in _lib.STRUCTS.items():
        last, ctype = py._fields_[-1]
        end = getattr(py, last).offset + ctypes.sizeof(ctype)
        assert c_layout[cname] - end < ctypes.alignment(py), cname


def test_enums(c_layout):
    for code, name in enumerate(_lib.STATUS_NAMES):
        assert c_layout["NSA_STATUS_" + name] == code
    assert c_layout["NSA_DTYPE_F32"] == _lib.DTYPE_F32
    assert c_layout["NSA_DTYPE_F16"] == _lib.DTYPE_F16
    assert c_layout["NSA_DTYPE_BF16"] == _lib.DTYPE_BF16
    assert c_layout["NSA_DTYPE_I32"] == _lib.DTYPE_I32
    assert c_layout["NSA_DTYPE_U8"] == _lib.DTYPE_U8
    assert c_layout["NSA_BACKEND_CPU"] == _lib.BACKEND_CPU
    assert c_layout["NSA_BACKEND_CUDA"] == _lib.BACKEND_CUDA
    assert c_layout["NSA_MAX_RANK"] == _lib.MAX_RANK
    # the header the tests compile against is the one the loaded library was built from
    assert c_layout["NSA_VERSION_NUMBER"] == nsa.library.nsa_version_number()


def test_tensor_make_matches_python_views():
    """nsa_tensor_4d through ctypes (struct returned by value) equals the binding's own views."""
    t = nsa.library.nsa_tensor_4d(None, _lib.DTYPE_BF16, 2, 3, 5, 7)
    assert (t.dtype, t.rank) == (_lib.DTYPE_BF16, 4)
    assert list(t.shape) == [2, 3, 5, 7]
    assert list(t.stride) == [105, 35, 7, 1]
    c = nsa.library.nsa_config_default()
    assert (c.cmp_len, c.cmp_stride, c.slc_block, c.slc_topk, c.n_init, c.n_local, c.window, c.scale) == \
        (32, 16, 64, 16, 1, 2, 512, 0.0)
