"""`make install` into a temporary prefix, then a small C program built against the installed
library the two ways a C / C++ project would: pkg-config (shared) and CMake's find_package(nsa)
(nsa::nsa shared, nsa::nsa_static static); each runs and computes. Also: the shared library
exports exactly nsa.h's functions, under its SONAME. Skips without cc, pkg-config or cmake."""
import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT

PROGRAM = r"""
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <nsa.h>

/* one query, two keys, causal: o = the softmax-weighted mean of v over both keys */
int main(void)
{
    if (nsa_version_number() != NSA_VERSION_NUMBER) return 1;
    nsa_context_desc d;
    memset(&d, 0, sizeof d);
    nsa_context *ctx = NULL;
    if (nsa_context_create(&ctx, &d) != NSA_STATUS_SUCCESS) return 2;
    float q[2 * 4] = {0, 0, 0, 0, 1, 0, 0, 0}, k[2 * 4] = {1, 0, 0, 0, 0, 1, 0, 0}, v[2 * 4] = {1, 2, 3, 4, 5, 6, 7, 8};
    float o[2 * 4], lse[2];
    nsa_attention_args a;
    memset(&a, 0, sizeof a);
    a.q = nsa_tensor_4d(q, NSA_DTYPE_F32, 1, 2, 1, 4);
    a.k = nsa_tensor_4d(k, NSA_DTYPE_F32, 1, 2, 1, 4);
    a.v = nsa_tensor_4d(v, NSA_DTYPE_F32, 1, 2, 1, 4);
    a.o = nsa_tensor_4d(o, NSA_DTYPE_F32, 1, 2, 1, 4);
    a.lse = nsa_tensor_3d(lse, NSA_DTYPE_F32, 1, 2, 1);
    a.causal = 1, a.window_left = -1, a.window_right = -1, a.scale = 1.0f;
    size_t need = 0;
    if (nsa_attention_workspace_size(ctx, &a, &need) != NSA_STATUS_SUCCESS) return 3;
    void *ws = malloc(need ? need : 1);
    if (nsa_attention(ctx, &a, ws, need) != NSA_STATUS_SUCCESS) return 4;
    free(ws);
    /* row 1: scores (q1 . k0, q1 . k1) = (1, 0): weights e / (e + 1), 1 / (e + 1) */
    const float w0 = expf(1.0f) / (expf(1.0f) + 1.0f);
    if (fabsf(o[4] - (w0 * 1 + (1 - w0) * 5)) > 1e-5f || o[0] != 1.0f) return 5;
    printf("nsa %s ok\n", nsa_version_string());
    nsa_context_destroy(ctx);
    return 0;
}
"""

CMAKE = """cmake_minimum_required(VERSION 3.16)
project(use_nsa C)
find_package(nsa 0.2 REQUIRED)
add_executable(use_shared use.c)
target_link_libraries(use_shared nsa::nsa m)
add_executable(use_static use.c)
target_link_libraries(use_static nsa::nsa_static m)
"""


def _need(*tools):
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip("no %s on PATH" % ", ".join(missing))


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    _need("make", "cc")
    p = tmp_path_factory.mktemp("prefix")
    # the same configuration as the build that runs this test (make passes its variables on)
    subprocess.run(["make", "-C", ROOT, "-s", "install", "PREFIX=" + str(p)], check=True,
                   stdout=subprocess.DEVNULL)
    return p


def _run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def test_installed_files(prefix):
    lib = prefix / "lib"
    for rel in ("include/nsa.h", "lib/libnsa.a", "lib/pkgconfig/nsa.pc", "lib/cmake/nsa/nsaConfig.cmake",
                "lib/cmake/nsa/nsaConfigVersion.cmake", "bin/nsa", "share/licenses/nsa/LICENSE"):
        assert (prefix / rel).exists(), rel
    real = os.path.realpath(lib / "libnsa.so")
    assert re.search(r"libnsa\.so\.\d+\.\d+\.\d+$", real)
    if shutil.which("readelf"):
        assert "Library soname: [libnsa.so." in _run(["readelf", "-d", real]).stdout
    if shutil.which("nm"):
        exported = sorted(line.split()[-1] for line in _run(["nm", "-D", "--defined-only", real]).stdout.splitlines())
        with open(os.path.join(ROOT, "include", "nsa.h")) as f:
            api = sorted(re.findall(r"^NSA_API[^(]*?\b(nsa_\w+)\(", f.read(), re.M))
        assert exported == api


def test_pkg_config_consumer(prefix, tmp_path):
    _need("pkg-config")
    src = tmp_path / "use.c"
    src.write_text(PROGRAM)
    env = dict(os.environ, PKG_CONFIG_PATH=str(prefix / "lib" / "pkgconfig"))
    flags = _run(["pkg-config", "--cflags", "--libs", "nsa"], env=env).stdout.split()
    assert _run(["pkg-config", "--modversion", "nsa"], env=env).stdout.strip().count(".") == 2
    exe = tmp_path / "use"
    _run(["cc", "-std=c11", str(src), "-o", str(exe)] + flags + ["-lm", "-Wl,-rpath," + str(prefix / "lib")])
    assert _run([str(exe)]).stdout.startswith("nsa ")


def test_cmake_consumer(prefix, tmp_path):
    _need("cmake")
    (tmp_path / "use.c").write_text(PROGRAM)
    (tmp_path / "CMakeLists.txt").write_text(CMAKE)
    build = tmp_path / "build"
    _run(["cmake", "-S", str(tmp_path), "-B", str(build), "-DCMAKE_PREFIX_PATH=" + str(prefix)])
    _run(["cmake", "--build", str(build)])
    for exe in ("use_shared", "use_static"):
        assert _run([str(build / exe)]).stdout.startswith("nsa "), exe
