"""KV caches for NSA inference: the token K/V and the compressed K/V of one attention layer for
a batch of sequences, contiguous or paged, and the step that appends to them (nsa.step).

    cache = nsa.KVCache(batch=8, heads=4, dk=128, dv=128, capacity=65536, config=cfg,
                        page_size=64, like=q)                  # paged, on q's device and dtype
    o = cache.step(q_prefill, k, v, g_cmp=..., g_slc=..., g_swa=...)   # a prefill chunk
    o = cache.step(q_next, k_next, v_next, g_cmp=..., ...)             # then one token per step
    cache.free(3)                                                      # sequence 3's pages back

Arrays are numpy (CPU) or torch (the device of `like`). Lengths are kept on the host and handed
to every step; pages are allocated from a free list as sequences grow (a step that would need
more pages than the pool has raises before anything is written).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

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
                 like: Optional[Array] = None):
        self.config = _core._as_config(config)
        self.batch, self.heads, self.dk, self.dv, self.capacity = batch, heads, dk, dv, capacity
        self.kind, self._m = _lib_for(like)
        self.dtype = dtype if dtype is not None else (like.dtype if like is not None else "float32")
        self.device = like.device if self.kind == "torch" and like is not None else None
        self.cmp_capacity = _core.num_cmp_rows(self.config, capacity)
        self.lengths: List[int] = [0] * batch
        self.page_size = page_size
        if page_size is None:
            self.k = self._zeros((batch, capacity, heads, dk))
            self.v = self._zeros((batch, capacity, heads, dv))
            self.k_cmp = self._zeros((batch, self.cmp_capacity, heads, dk))
            self.v_cmp = self._zeros((batch, self.cmp_capacity, heads, dv))
            self.block_table = self.cmp_table = None
            return
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.max_pages = -(-capacity // page_size)
        self.max_cmp_pages = -(-self.cmp_capacity // page_size)
        self.num_pages = num_pages if num_pages is not None else batch * self.max_pages
        self.num_cmp_pages = batch * self.max_cmp_pages  # (about 1/d of the tokens: every sequence at capacity)
        self.k = self._zeros((self.num_pages, page_size, heads, dk))
        self.v = self._zeros((self.num_pages, page_size, heads, dv))
        self.k_cmp = self._zeros((self.num_cmp_pages, page_size, heads, dk))
        self.v_cmp = self._zeros((self.num_cmp_pages, page_size, heads, dv))
        self._tables = [[[] for _ in range(batch)], [[] for _ in range(batch)]]  # pages per sequence
        self._free = [list(range(self.num_pages)), list(range(self.num_cmp_pages))]
        self.block_table = self._table(0)
        self.cmp_table = self._table(1)

    # ---- storage ---------------------------------------------------------------------------
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
