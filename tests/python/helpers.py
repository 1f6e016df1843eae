"""Shared by the Python tests: seeded inputs and the tolerance rule (style.md): the error of
the library against the float64 reference must be within 2x the error of a straightforward
same-precision implementation (plus a floor of a few ulps of the output's magnitude), for the
output and every gradient. NaN never passes; whole tensors are compared."""
import numpy as np


def rand_inputs(seed, B, T, HQ, H, DK, DV, dtype=np.float32, gates=("cmp", "slc", "swa")):
    rng = np.random.default_rng(seed)
    x = {
        "q": rng.standard_normal((B, T, HQ, DK)),
        "k": rng.standard_normal((B, T, H, DK)),
        "v": rng.standard_normal((B, T, H, DV)),
    }
    for g in ("cmp", "slc", "swa"):
        x["g_" + g] = rng.uniform(0.2, 1.0, (B, T, HQ)) if g in gates else None
    return {n: (None if a is None else a.astype(dtype)) for n, a in x.items()}


FLOOR = {np.dtype(np.float32): 2e-6, np.dtype(np.float16): 2e-3}


def check_close(name, got, ref64, ref_lp, floor=None, seed=None):
    """Tolerance rule on one whole tensor. ref_lp: the naive implementation in the storage
    precision. -inf (lse of rows that see nothing) must match exactly."""
    got = np.asarray(got, dtype=np.float64)
    ref64 = np.asarray(ref64, dtype=np.float64)
    ref_lp = np.asarray(ref_lp, dtype=np.float64)
    assert got.shape == ref64.shape, "%s: shape %s, reference %s" % (name, got.shape, ref64.shape)
    assert not np.isnan(got).any(), "%s: NaN at %s (seed %s)" % (name, np.argwhere(np.isnan(got))[:5], seed)
    inf_ref, inf_got = np.isinf(ref64), np.isinf(got)
    bad_inf = (inf_ref != inf_got) | (inf_ref & (np.sign(got) != np.sign(ref64)))
    assert not bad_inf.any(), "%s: infinities differ at %s (seed %s)" % (name, np.argwhere(bad_inf)[:5], seed)
    fin = ~inf_ref
    if not fin.any():
        return
    both = fin & np.isfinite(ref_lp)
    err = np.abs(np.where(fin, got, 0) - np.where(fin, ref64, 0)).max()
    base = np.abs(np.where(both, ref_lp, 0) - np.where(both, ref64, 0)).max()
    if floor is None:
        floor = 2e-6
    tol = 2 * base + floor * (1.0 + np.abs(ref64[fin]).max())
    if err > tol:
        diff = np.where(fin, np.abs(got - ref64), 0)
        where = np.argwhere(diff > tol)[:5]
        first = ", ".join("%s: got %.6g want %.6g" % (tuple(int(j) for j in i), got[tuple(i)], ref64[tuple(i)])
                          for i in where)
        raise AssertionError("%s: max error %.3g > tolerance %.3g (naive same-precision error %.3g, seed %s); "
                             "first mismatches %s" % (name, err, tol, base, seed, first))


def selection_agrees(got, want, importance_rows, cfg_T_lp, tol=1e-4):
    """Selections may differ only where the float64 importances of the swapped blocks are
    within `tol` (near ties the fp32 library may order differently). importance_rows(t, h)
    returns the importance vector of row (t, h). Returns the number of rows that differ."""
    got, want = np.asarray(got), np.asarray(want)
    differing = 0
    T, H = got.shape[0], got.shape[1]
    for t in range(T):
        for h in range(H):
            a, b = set(got[t, h].tolist()) - {-1}, set(want[t, h].tolist()) - {-1}
            if a == b:
                continue
            differing += 1
            imp = importance_rows(t, h)
            only_got, only_want = a - b, b - a
            assert len(only_got) == len(only_want), "row (%d, %d): %s vs %s" % (t, h, sorted(a), sorted(b))
            lo_want = min(imp[j] for j in b)
            for j in only_got:
                assert abs(imp[j] - lo_want) <= tol, "row (%d, %d): block %d (importance %.6g) chosen over %s" % (
                    t, h, j, imp[j], sorted(only_want))
    return differing
