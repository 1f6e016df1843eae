"""pytest plugin: fla's own NSA tests (tests/ops/test_nsa.py of fla-org/flash-linear-attention)
with the one name through which they call fla's parallel_nsa bound to nsa.parallel_nsa instead.
fla's naive_nsa*, mean_pooling and assert_close stay the judge; nothing else of fla changes.

Loaded by tests/python/test_fla_suite.py as `pytest -p nsa_fla_swap <fla>/tests/ops/test_nsa.py`
(this folder on PYTHONPATH). It
  - rebinds every global of the collected test modules that is fla.ops.nsa.parallel.parallel_nsa
    (test_nsa.py imports it by name at import time, so patching fla's module would come too late);
  - keeps only the test functions that name such a global (the others test fla's own kernels:
    parallel_nsa_fwd, parallel_nsa_topk, parallel_nsa_compression) and deselects the rest;
  - marks the known gaps below strict xfail, with the exception type they must raise;
  - records each case's outcome and every call that reached nsa in the JSON file $NSA_FLA_REPORT.
"""
import importlib
import json
import os
import types

import pytest

# The known gaps of nsa.parallel_nsa against fla's tests, and how each shows. `call` is the
# index of the nsa call that must raise: every call before it returned, and since fla asserts
# the full-length half before it starts the decode half, reaching call 1 means those passed.
# The known gaps of nsa.parallel_nsa against fla's tests, and how each shows: gap name ->
# {"reason", "exc" (the exception's type name), "match" (a regex on its message), "call" (the
# index of the nsa call that must raise: every call before it returned)}. None today: the
# decoding halves (q shorter than k, cu_seqlens=(cu_q, cu_k)) run on nsa_step.
GAPS = {}

# fla's case ids (fla-org/flash-linear-attention bc3b101dcb71, tests/ops/test_nsa.py) -> gap.
# Every case that calls parallel_nsa must pass. The decode cases with W > 0 need flash_attn
# for fla's naive window branch and skip (fla's own importorskip) where it is absent.
KNOWN_GAPS = {}

_calls = []      # the nsa calls of the running case
_cases = {}      # nodeid -> record
_state = {"swapped": [], "deselected": [], "stale": []}


def _swapped(*args, **kwargs):
    """nsa.parallel_nsa, noting whether each call returned or what it raised."""
    import nsa
    try:
        out = nsa.parallel_nsa(*args, **kwargs)
    except BaseException as e:
        _calls.append({"ok": False, "exc": type(e).__name__, "msg": str(e)[:400]})
        raise
    _calls.append({"ok": True})
    return out


def _names_in(code):
    """Every global a function's code (nested code objects too) reads."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names_in(c)
    return names


def pytest_collection_modifyitems(session, config, items):
    fla_fn = importlib.import_module("fla.ops.nsa.parallel").parallel_nsa
    import nsa
    done, names = set(), set()
    for item in items:
        mod = getattr(item, "module", None)
        if mod is None or id(mod) in done:
            continue
        done.add(id(mod))
        for name, value in list(vars(mod).items()):
            if value is fla_fn:
                setattr(mod, name, _swapped)
                names.add(name)
                _state["swapped"].append("%s.%s" % (mod.__name__, name))
    if not names:
        raise pytest.UsageError("nsa_fla_swap: no test module global is fla.ops.nsa.parallel.parallel_nsa; "
                                "the swap would test fla itself")
    keep, drop = [], []
    for item in items:
        fn = getattr(item, "function", None)
        (keep if fn is not None and _names_in(fn.__code__) & names else drop).append(item)
    for item in keep:
        gap = KNOWN_GAPS.get(item.name)
        if gap:
            exc = nsa.NsaError if GAPS[gap]["exc"] == "NsaError" else NotImplementedError
            item.add_marker(pytest.mark.xfail(reason=GAPS[gap]["reason"], raises=exc, strict=True))
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
    _state["deselected"] = [item.name for item in drop]
    collected = {item.name for item in keep}
    _state["stale"] = sorted(n for n in KNOWN_GAPS if n not in collected)


def pytest_runtest_logstart(nodeid, location):
    del _calls[:]


def pytest_runtest_logreport(report):
    rec = _cases.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "passed", "message": ""})
    name = report.nodeid.split("::")[-1]
    rec["name"] = name
    rec["gap"] = KNOWN_GAPS.get(name)
    if report.failed:
        rec["outcome"] = "failed"
        crash = getattr(report.longrepr, "reprcrash", None)
        rec["message"] = ("%s: " % report.when) + (crash.message if crash else str(report.longrepr))[-600:]
    elif report.skipped and rec["outcome"] == "passed":
        if hasattr(report, "wasxfail"):
            rec["outcome"] = "xfailed"
            crash = getattr(report.longrepr, "reprcrash", None)
            rec["message"] = crash.message[-600:] if crash else ""
        else:
            rec["outcome"] = "skipped"
            rec["message"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def pytest_runtest_logfinish(nodeid, location):
    if nodeid in _cases:
        _cases[nodeid]["calls"] = list(_calls)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("NSA_FLA_REPORT")
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"exitstatus": int(exitstatus), "swapped": _state["swapped"], "deselected": _state["deselected"],
                   "stale_gaps": _state["stale"], "cases": list(_cases.values())}, f, indent=1)
