"""nsa -- Native Sparse Attention (DeepSeek, arXiv 2502.11089), Python binding of the C library.

The shared library is found next to this package, in the repository's build/ folder, or
through the NSA_LIBRARY environment variable. Loading it has no other dependency.
"""
import ctypes
import os

__all__ = ["library", "version", "status_string", "backend_available", "NsaError"]

_HERE = os.path.dirname(os.path.abspath(__file__))


def _candidates():
    env = os.environ.get("NSA_LIBRARY")
    if env:
        yield env
    yield os.path.join(_HERE, "libnsa.so")
    yield os.path.join(_HERE, "..", "..", "build", "libnsa.so")


def _load():
    tried = []
    for path in _candidates():
        path = os.path.abspath(path)
        if os.path.exists(path):
            lib = ctypes.CDLL(path)
            lib.nsa_version_string.restype = ctypes.c_char_p
            lib.nsa_status_string.restype = ctypes.c_char_p
            lib.nsa_status_string.argtypes = [ctypes.c_int]
            lib.nsa_backend_available.argtypes = [ctypes.c_int]
            return lib
        tried.append(path)
    raise ImportError("nsa: libnsa.so not found (run `make`, or set NSA_LIBRARY); looked in " + ", ".join(tried))


library = _load()


class NsaError(RuntimeError):
    """A C call returned a status other than success; .status holds the code."""

    def __init__(self, status):
        self.status = int(status)
        super().__init__("nsa status %d: %s" % (self.status, status_string(self.status)))


def version():
    """The linked C library's version, "MAJOR.MINOR.PATCH"."""
    return library.nsa_version_string().decode()


def status_string(status):
    """The C library's description of a status code."""
    return library.nsa_status_string(int(status)).decode()


def backend_available(name):
    """True when backend "cpu" or "cuda" is compiled in and usable here."""
    codes = {"cpu": 0, "cuda": 1}
    if name not in codes:
        raise ValueError("backend must be 'cpu' or 'cuda', not %r" % (name,))
    return bool(library.nsa_backend_available(codes[name]))
