"""KV caches for NSA inference: the token K/V and the compressed K/V of one attention layer for
a batch of sequences, contiguous or paged, and the step that appends to them (nsa.step).

    cache = nsa.KVCache(batch=8, heads=4, dk=128, dv=128, capacity=65536, config=cfg,
                        page_size=64, like=q)                  # paged, on q's device and dtype
    o = cache.step(q_prefill, k, v, g_cmp=..., g_slc=..., g_swa=...)   # a prefill chunk
    o = cache.step(q_next, k_next, v_next, g_cmp=..., ...)             # then one token per step
    cache.free(3)                                                      # sequence 3's pages back

A layer that computes its own compressed rows (a learnable phi, nsa.nn.NativeSparseAttention)
appends first, reads the blocks its new tokens complete, writes their compression and attends:

    cache.append(k, v, q_lens=counts)                 # the tokens, lengths advanced
    for b, first, stop in cache.completed(counts):    # compressed rows [first, stop) of sequence b
        ...  cache.tokens(b, first * d, (stop - 1) * d + l) -> phi -> cache.write_cmp(b, first, kc, vc)
    o = cache.attend(q, q_lens=counts, g_cmp=..., g_slc=..., g_swa=..., cmp_by_caller=True)

separate_kv=True keeps separate K/V for the selected and window branches (the paper's choice;
nsa.forward's k_slc / k_swa), in pools that share the block tables of the main cache.

Arrays are numpy (CPU) or torch (the device of `like`). Lengths are kept on the host and handed
to every step; pages are allocated from a free list as sequences grow (a step that would need
more pages than the pool has raises before anything is written).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from . import _core

Array = Any


def _lib_for(like):
    if like is not None and type(like).__module__.startswith("torch"):
        import torch
        return "torch", torch
    import numpy
    return "numpy", numpy


class KVCache:
    """The caches of one layer for `batch` sequences of up to `capacity` tokens each.

    heads: kv heads H; dk, dv: head dims. config: the NSA config (its compression fixes the
    compressed cache's rows). page_size None: contiguous [batch, capacity, H, D] tensors;
    else paged pools [num_pages, page_size, H, D] (num_pages default: enough for every sequence
    at full capacity) with block tables [batch, max_pages] and a free list. dtype / like: the
    storage (like: an array whose library, device and dtype the caches take)."""

    def __init__(self, batch: int, heads: int, dk: int, dv: int, capacity: int, config: Optional[_core.Config] = None,
                 *, page_size: Optional[int] = None, num_pages: Optional[int] = None, dtype: Any = None,
                 like: Optional[Array] = None, separate_kv: bool = False):
        self.config = _core._as_config(config)
        self.batch, self.heads, self.dk, self.dv, self.capacity = batch, heads, dk, dv, capacity
        self.kind, self._m = _lib_for(like)
        self.dtype = dtype if dtype is not None else (like.dtype if like is not None else "float32")
        self.device = like.device if self.kind == "torch" and like is not None else None
        self.cmp_capacity = _core.num_cmp_rows(self.config, capacity)
        self.lengths: List[int] = [0] * batch
        self.page_size = page_size
        self.separate_kv = separate_kv
        if page_size is None:
            self.k = self._zeros((batch, capacity, heads, dk))
            self.v = self._zeros((batch, capacity, heads, dv))
            self.k_cmp = self._zeros((batch, self.cmp_capacity, heads, dk))
            self.v_cmp = self._zeros((batch, self.cmp_capacity, heads, dv))
            self._branch_pools()
            self.block_table = self.cmp_table = None
            return
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.max_pages = -(-capacity // page_size)
        # (at least one compressed page and table column: an empty table would read as absent)
        self.max_cmp_pages = max(1, -(-self.cmp_capacity // page_size))
        self.num_pages = num_pages if num_pages is not None else batch * self.max_pages
        self.num_cmp_pages = batch * self.max_cmp_pages  # (about 1/d of the tokens: every sequence at capacity)
        self.k = self._zeros((self.num_pages, page_size, heads, dk))
        self.v = self._zeros((self.num_pages, page_size, heads, dv))
        self.k_cmp = self._zeros((self.num_cmp_pages, page_size, heads, dk))
        self.v_cmp = self._zeros((self.num_cmp_pages, page_size, heads, dv))
        self._branch_pools()
        self._tables = [[[] for _ in range(batch)], [[] for _ in range(batch)]]  # pages per sequence
        self._free = [list(range(self.num_pages)), list(range(self.num_cmp_pages))]
        self.block_table = self._table(0)
        self.cmp_table = self._table(1)

    # ---- storage ---------------------------------------------------------------------------
    def _branch_pools(self):
        """The selected and window branches' own K/V (separate_kv), shaped like k and v."""
        self.k_slc = self.v_slc = self.k_swa = self.v_swa = None
        if self.separate_kv:
            self.k_slc, self.v_slc = self._zeros(tuple(self.k.shape)), self._zeros(tuple(self.v.shape))
            self.k_swa, self.v_swa = self._zeros(tuple(self.k.shape)), self._zeros(tuple(self.v.shape))

    def _zeros(self, shape, dtype=None):
        dt = self.dtype if dtype is None else dtype
        if self.kind == "torch":
            return self._m.zeros(shape, dtype=dt, device=self.device)
        return self._m.zeros(shape, dtype=dt)

    def _ints(self, values):
        if self.kind == "torch":
            return self._m.tensor(values, dtype=self._m.int32, device=self.device)
        return self._m.asarray(values, dtype=self._m.int32)

    def _table(self, which):
        width = self.max_pages if which == 0 else self.max_cmp_pages
        rows = [t + [0] * (width - len(t)) for t in self._tables[which]]  # unused entries are never read
        return self._ints(rows).reshape(self.batch, width)

    def reserve(self, b: int, tokens: int) -> None:
        """Pages for sequence b to hold `tokens` tokens (and their compressed rows); paged
        caches only. Raises before changing anything when the pool runs out."""
        if tokens > self.capacity:
            raise ValueError("sequence %d: %d tokens exceed the capacity of %d" % (b, tokens, self.capacity))
        if self.page_size is None:
            return
        need = [-(-tokens // self.page_size), -(-_core.num_cmp_rows(self.config, tokens) // self.page_size)]
        extra = [max(0, need[w] - len(self._tables[w][b])) for w in (0, 1)]
        if any(extra[w] > len(self._free[w]) for w in (0, 1)):
            raise MemoryError("KVCache: sequence %d needs %d more pages (%d free) and %d more compressed pages (%d free)"
                              % (b, extra[0], len(self._free[0]), extra[1], len(self._free[1])))
        for w in (0, 1):
            for _ in range(extra[w]):
                self._tables[w][b].append(self._free[w].pop(0))
        self.block_table, self.cmp_table = self._table(0), self._table(1)

    def free(self, b: int) -> None:
        """Sequence b starts over: its length 0, its pages back in the pool."""
        self.lengths[b] = 0
        if self.page_size is None:
            return
        for w in (0, 1):
            self._free[w].extend(self._tables[w][b])
            self._tables[w][b] = []
        self.block_table, self.cmp_table = self._table(0), self._table(1)

    # ---- the step --------------------------------------------------------------------------
    def step(self, q: Array, k_new: Array, v_new: Array, *, q_lens: Optional[Sequence[int]] = None,
             g_cmp: Optional[Array] = None, g_slc: Optional[Array] = None, g_swa: Optional[Array] = None,
             block_indices: Optional[Array] = None, block_counts: Optional[Array] = None,
             return_selected: bool = False):
        """Appends the step's tokens (k_new, v_new [batch, Tq, H, D]; q_lens[b] of them for
        sequence b, default Tq each) and returns nsa.step's o [batch, Tq, HQ, DV] for the
        queries q [batch, Tq, HQ, DK] at those positions (and the selection when asked). The
        compressed rows the new tokens complete are pooled into the compressed cache."""
        Tq = q.shape[1]
        counts = list(q_lens) if q_lens is not None else [Tq] * self.batch
        if len(counts) != self.batch or any(n < 0 or n > Tq for n in counts):
            raise ValueError("q_lens: one count in [0, %d] per sequence" % Tq)
        for b, n in enumerate(counts):  # (all checks and page allocations before the call writes)
            self.reserve(b, self.lengths[b] + n)
        cache = (self.k, self.v) if self.page_size is None else (self.k, self.v, self.block_table)
        cmp_cache = (self.k_cmp, self.v_cmp) if self.page_size is None else (self.k_cmp, self.v_cmp, self.cmp_table)
        from . import step
        out = step(q, cache, self._ints(self.lengths), self.config, q_lens=self._ints(counts), k_new=k_new, v_new=v_new,
                   cmp_cache=cmp_cache, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, block_indices=block_indices,
                   block_counts=block_counts, return_selected=return_selected)
        for b, n in enumerate(counts):
            self.lengths[b] += n
        return out

    # ---- the layer's path: append, read blocks, write compressed rows, attend ---------------
    def _counts(self, Tq, q_lens):
        counts = [int(n) for n in q_lens] if q_lens is not None else [Tq] * self.batch
        if len(counts) != self.batch or any(n < 0 or n > Tq for n in counts):
            raise ValueError("q_lens: one count in [0, %d] per sequence" % Tq)
        return counts

    def _where(self, b, start, stop, which=0):
        """Index of rows [start, stop) of sequence b into a pool (which 0: tokens, 1: compressed
        rows; contiguous: (b, slice))."""
        if self.page_size is None:
            return (b, slice(start, stop))
        rows = list(range(start, stop))
        pages = [self._tables[which][b][r // self.page_size] for r in rows]
        offs = [r % self.page_size for r in rows]
        if self.kind == "torch":
            m = self._m
            return (m.tensor(pages, dtype=m.long, device=self.device), m.tensor(offs, dtype=m.long, device=self.device))
        return (self._m.asarray(pages, dtype=self._m.int64), self._m.asarray(offs, dtype=self._m.int64))

    def append(self, k_new: Array, v_new: Array, *, q_lens: Optional[Sequence[int]] = None,
               k_slc: Optional[Array] = None, v_slc: Optional[Array] = None, k_swa: Optional[Array] = None,
               v_swa: Optional[Array] = None) -> List[int]:
        """Writes rows 0 .. q_lens[b] - 1 of k_new, v_new [batch, Tq, H, D] (and, with
        separate_kv, of k_slc / v_slc / k_swa / v_swa) after the cached tokens of each sequence
        and advances the lengths. Returns the lengths before the append. Pages are reserved (or
        MemoryError raised) before anything is written."""
        counts = self._counts(k_new.shape[1], q_lens)
        extra = (k_slc, v_slc, k_swa, v_swa)
        if self.separate_kv and any(x is None for x in extra):
            raise ValueError("KVCache(separate_kv=True).append needs k_slc, v_slc, k_swa and v_swa")
        for b, n in enumerate(counts):
            if self.lengths[b] + n > self.capacity:
                raise ValueError("sequence %d: %d tokens exceed the capacity of %d" % (b, self.lengths[b] + n, self.capacity))
        for b, n in enumerate(counts):
            self.reserve(b, self.lengths[b] + n)
        before = list(self.lengths)
        pairs = [(self.k, k_new), (self.v, v_new)]
        if self.separate_kv:
            pairs += [(self.k_slc, k_slc), (self.v_slc, v_slc), (self.k_swa, k_swa), (self.v_swa, v_swa)]
        for b, n in enumerate(counts):
            if n == 0:
                continue
            at = self._where(b, before[b], before[b] + n)
            for pool, new in pairs:
                pool[at] = new[b, :n]
            self.lengths[b] += n
        return before

    def completed(self, q_lens: Sequence[int]) -> List[Tuple[int, int, int]]:
        """After an append of q_lens[b] tokens: (b, first, stop) for each sequence whose new tokens
        complete compressed rows first .. stop - 1 (rows ending at one of them)."""
        out = []
        for b, n in enumerate(q_lens):
            L = self.lengths[b]
            first, stop = _core.num_cmp_rows(self.config, L - int(n)), _core.num_cmp_rows(self.config, L)
            if stop > first:
                out.append((b, first, stop))
        return out

    def tokens(self, b: int, start: int, stop: int) -> Tuple[Array, Array]:
        """The cached K and V rows [start, stop) of sequence b: ([n, H, DK], [n, H, DV])."""
        if not 0 <= start <= stop <= self.lengths[b]:
            raise ValueError("sequence %d: rows [%d, %d) outside its %d tokens" % (b, start, stop, self.lengths[b]))
        at = self._where(b, start, stop)
        return self.k[at], self.v[at]

    def write_cmp(self, b: int, first: int, k_rows: Array, v_rows: Array) -> None:
        """The caller's compressed rows first .. first + n - 1 of sequence b ([n, H, D] each)."""
        n = k_rows.shape[0]
        if first < 0 or first + n > _core.num_cmp_rows(self.config, self.lengths[b]):
            raise ValueError("sequence %d: compressed rows [%d, %d) beyond its %d" % (
                b, first, first + n, _core.num_cmp_rows(self.config, self.lengths[b])))
        at = self._where(b, first, first + n, which=1)
        self.k_cmp[at] = k_rows
        self.v_cmp[at] = v_rows

    def _pool_completed(self, counts):
        """Mean pooling (spec 1) of the compressed rows the last append completed, in float32."""
        c = self.config
        for b, first, stop in self.completed(counts):
            k, v = self.tokens(b, first * c.cmp_stride, (stop - 1) * c.cmp_stride + c.cmp_len)
            rows = [[x[i * c.cmp_stride - first * c.cmp_stride:][:c.cmp_len] for i in range(first, stop)] for x in (k, v)]
            if self.kind == "torch":
                m = self._m
                kc, vc = (m.stack([r.float().sum(0) / c.cmp_len for r in rs]).to(self.k.dtype) for rs in rows)
            else:
                kc, vc = (self._m.stack([r.astype("float32").sum(0) / c.cmp_len for r in rs]).astype(self.k.dtype)
                          for rs in rows)
            self.write_cmp(b, first, kc, vc)

    def attend(self, q: Array, *, q_lens: Optional[Sequence[int]] = None, g_cmp: Optional[Array] = None,
               g_slc: Optional[Array] = None, g_swa: Optional[Array] = None, cmp_by_caller: bool = False,
               block_indices: Optional[Array] = None, block_counts: Optional[Array] = None):
        """NSA of q [batch, Tq, HQ, DK], whose q_lens[b] queries are the last tokens already
        appended to sequence b, against the caches (nsa.step without k_new). cmp_by_caller:
        the compressed rows were written with write_cmp; else they are pooled here. With
        separate_kv the branches read their own K/V (one step per branch, summed)."""
        counts = self._counts(q.shape[1], q_lens)
        for b, n in enumerate(counts):
            if n > self.lengths[b]:
                raise ValueError("sequence %d: %d queries but %d cached tokens" % (b, n, self.lengths[b]))
        from . import step
        seqlens, qlens = self._ints(self.lengths), self._ints(counts)
        bt = (self.block_table,) if self.page_size is not None else ()
        cmp_cache = (self.k_cmp, self.v_cmp) if self.page_size is None else (self.k_cmp, self.v_cmp, self.cmp_table)
        kw = dict(q_lens=qlens, cmp_cache=cmp_cache, block_indices=block_indices, block_counts=block_counts)
        if not self.separate_kv:
            return step(q, (self.k, self.v) + bt, seqlens, self.config, cmp_by_caller=cmp_by_caller, g_cmp=g_cmp,
                        g_slc=g_slc, g_swa=g_swa, **kw)
        if not cmp_by_caller and g_cmp is None and g_slc is not None and block_indices is None:
            self._pool_completed(counts)  # (the compressed rows pool the main k, v; no call below reads them)
            cmp_by_caller = True
        out = None
        for pool, gates in (((self.k, self.v), dict(g_cmp=g_cmp)), ((self.k_slc, self.v_slc), dict(g_slc=g_slc)),
                            ((self.k_swa, self.v_swa), dict(g_swa=g_swa))):
            if all(g is None for g in gates.values()):
                continue
            # the compressed rows pool the main k, v: the first call (g_cmp's, on them) pools them
            o = step(q, pool + bt, seqlens, self.config, cmp_by_caller=cmp_by_caller or pool[0] is not self.k, **gates, **kw)
            out = o if out is None else out + o
        if out is None:
            raise ValueError("KVCache.attend: at least one gate is needed")
        return out
