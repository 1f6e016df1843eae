"""pytest setup for the Python binding: the package from python/, the library from build/
(built with `make build/libnsa.so` when neither it nor NSA_LIBRARY is there), and the
fixtures that skip torch / CUDA tests with a reason when those are absent."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(__file__))

if not os.environ.get("NSA_LIBRARY") and not os.path.exists(os.path.join(ROOT, "build", "libnsa.so")) \
        and not os.path.exists(os.path.join(ROOT, "python", "nsa", "libnsa.so")):
    subprocess.run(["make", "-C", ROOT, "build/libnsa.so"], check=True)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


TORCH = _torch()


def pytest_report_header(config):
    import nsa
    lines = ["nsa %s from %s" % (nsa.version(), nsa._lib.library_path)]
    if TORCH is None:
        lines.append("torch: not installed (torch tests skip)")
    else:
        cuda = TORCH.cuda.is_available() and nsa.backend_available("cuda")
        lines.append("torch %s, nsa cuda backend usable: %s" % (TORCH.__version__, cuda))
    return lines


def devices():
    """cpu always; cuda when torch sees a GPU and libnsa has the CUDA backend."""
    out = ["cpu"]
    if TORCH is not None and TORCH.cuda.is_available():
        import nsa
        out.append(pytest.param("cuda", marks=pytest.mark.skipif(
            not nsa.backend_available("cuda"), reason="libnsa.so built without the CUDA backend")))
    else:
        out.append(pytest.param("cuda", marks=pytest.mark.skip(reason="no CUDA device (or no torch)")))
    return out
