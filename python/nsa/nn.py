"""nsa.nn.NativeSparseAttention: an attention layer with NSA inside (needs PyTorch).

    hidden [B, T, C] -> q, k, v projections (GQA: HQ query heads, H kv heads) -> RoPE on q, k
    -> learnable compression phi of k and v (an MLP over overlapping blocks of l tokens, stride
       d, with an intra-block position embedding, as in the paper) -> k_cmp, v_cmp
    -> gates: an MLP on hidden + sigmoid, one gate per branch and query head
    -> nsa.native_sparse_attention(q, k, v, g_cmp, g_slc, g_swa, config, k_cmp, v_cmp)
    -> output projection [B, T, C]

Works in float32, bfloat16 and float16 on the CPU and CUDA (float32 on CUDA runs on scalar
kernels, 300-450x slower: use bf16 parameters or torch.autocast to train), under torch.compile(fullgraph=True)
without cu_seqlens. With cu_seqlens (packed sequences, B == 1) positions restart at 0 in
every sequence and compression blocks never straddle two sequences.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

import nsa


def _cu_list(cu_seqlens):
    return nsa._core.cu_seqlens_list(cu_seqlens)


def positions(T, cu_seqlens, device):
    """Token positions [T]: 0..T-1, or restarting at every sequence of cu_seqlens."""
    if cu_seqlens is None:
        return torch.arange(T, device=device)
    cu = _cu_list(cu_seqlens)
    return torch.cat([torch.arange(cu[s + 1] - cu[s], device=device) for s in range(len(cu) - 1)]
                     + [torch.zeros(0, dtype=torch.long, device=device)])


class RotaryEmbedding(nn.Module):
    """RoPE (rotate-half form) over the last dim of [B, T, heads, D], computed in float32."""

    def __init__(self, head_dim, theta=10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError("RoPE needs an even head_dim, got %d" % head_dim)
        self.head_dim, self.theta = head_dim, theta

    def forward(self, x, pos):
        """pos: [T] (every sequence alike) or [B, T] (per sequence: a cached step's positions)."""
        # frequencies made here in float32 (a buffer would follow module.to(bfloat16))
        d = self.head_dim
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=pos.device) / d))
        ang = pos.to(torch.float32)[..., None] * inv  # [T, D/2] or [B, T, D/2]
        if ang.dim() == 2:
            ang = ang[None]
        cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Compression(nn.Module):
    """Learnable phi of the paper: block i = tokens [i*d, i*d + l) of one head, plus a learned
    intra-block position embedding [l, D], flattened and mapped by a 2-layer MLP to one
    vector of D. With residual=True the mean of the block is added, so that at
    initialisation phi is close to the library's default mean pooling (stabler training).
    [B, T, H, D] -> [B, Nc, H, D]; packed rows (nsa.cmp_offsets) under cu_seqlens."""

    def __init__(self, head_dim, cmp_len, cmp_stride, hidden=None, residual=True):
        super().__init__()
        self.l, self.d, self.residual = cmp_len, cmp_stride, residual
        hidden = hidden or 2 * head_dim
        self.pos = nn.Parameter(torch.zeros(cmp_len, head_dim))
        self.fc1 = nn.Linear(cmp_len * head_dim, hidden)
        self.fc2 = nn.Linear(hidden, head_dim)
        nn.init.normal_(self.pos, std=0.02)
        nn.init.zeros_(self.fc2.weight)  # start at the mean (residual) and learn from there
        nn.init.zeros_(self.fc2.bias)

    def blocks(self, x, cu_seqlens=None):
        """[B, Nc, H, l, D] overlapping blocks (never across sequences)."""
        B, T, H, D = x.shape
        l, d = self.l, self.d
        if cu_seqlens is None:
            if T < l:
                return x.new_zeros((B, 0, H, l, D))
            return x.unfold(1, l, d).permute(0, 1, 2, 4, 3)  # [B, Nc, H, D, l] -> [B, Nc, H, l, D]
        cu = _cu_list(cu_seqlens)
        starts = [cu[s] + i * d for s in range(len(cu) - 1)
                  for i in range(max((cu[s + 1] - cu[s] - l) // d + 1, 0))]
        idx = torch.tensor(starts, dtype=torch.long, device=x.device)[:, None] + torch.arange(l, device=x.device)
        return x[:, idx].permute(0, 1, 3, 2, 4)  # [B, Nc, l, H, D] -> [B, Nc, H, l, D]

    def forward(self, x, cu_seqlens=None):
        return self.compress_blocks(self.blocks(x, cu_seqlens))

    def compress_blocks(self, blk):
        """phi of blocks [..., l, D] -> [..., D]."""
        h = F.silu(self.fc1((blk + self.pos.to(blk.dtype)).flatten(-2)))
        y = self.fc2(h)
        if self.residual:
            y = y + blk.mean(dim=-2)
        return y


class NativeSparseAttention(nn.Module):
    """NSA attention layer. hidden_size C; num_heads HQ; num_kv_heads H (GQA, HQ % H == 0;
    default HQ); head_dim D (default C / HQ); config: nsa.Config (default the paper's);
    separate_kv: independent K/V projections for the selection and window branches (the
    paper's choice against shortcut learning; default False shares k, v); gate_hidden: width
    of the gate MLP; phi_hidden: width of the compression MLP; learnable_compression=False
    uses the library's mean pooling instead of phi.

    forward(hidden [B, T, C], cu_seqlens=None, return_aux=False) -> [B, T, C]
    (and nsa.Aux with return_aux).

    Inference: cache = layer.new_cache(batch, capacity, page_size=...) (an nsa.KVCache), then
    forward(hidden [B, Tq, C], cache=cache, q_lens=None) for a prefill chunk and for every
    decode step: sequence b's q_lens[b] (default Tq) new tokens continue it at the positions
    after its cached ones; their K/V (and the compressed rows they complete, through phi) go
    into the cache, and the output rows are those of forward() over the whole sequence (rows
    past q_lens[b] are 0). No autograd on this path."""

    def __init__(self, hidden_size, num_heads, num_kv_heads=None, head_dim=None, config=None, rope_theta=10000.0,
                 bias=False, separate_kv=False, gate_hidden=None, phi_hidden=None, learnable_compression=True):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim or hidden_size // num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads (%d) must be a multiple of num_kv_heads (%d)" % (num_heads, self.num_kv_heads))
        self.config = (config or nsa.Config()).validate()
        HQ, H, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(hidden_size, HQ * D, bias=bias)
        self.k_proj = nn.Linear(hidden_size, H * D, bias=bias)
        self.v_proj = nn.Linear(hidden_size, H * D, bias=bias)
        self.separate_kv = separate_kv
        if separate_kv:
            self.kv_slc_proj = nn.Linear(hidden_size, 2 * H * D, bias=bias)
            self.kv_swa_proj = nn.Linear(hidden_size, 2 * H * D, bias=bias)
        self.rope = RotaryEmbedding(D, rope_theta)
        self.learnable_compression = learnable_compression
        if learnable_compression:
            c = self.config
            self.k_phi = Compression(D, c.cmp_len, c.cmp_stride, phi_hidden)
            self.v_phi = Compression(D, c.cmp_len, c.cmp_stride, phi_hidden)
        gate_hidden = gate_hidden or max(16, hidden_size // 4)
        self.gate = nn.Sequential(nn.Linear(hidden_size, gate_hidden), nn.SiLU(), nn.Linear(gate_hidden, 3 * HQ))
        self.o_proj = nn.Linear(HQ * D, hidden_size, bias=bias)
        nn.init.normal_(self.o_proj.weight, std=0.02 / math.sqrt(2))

    def new_cache(self, batch, capacity, *, page_size=None, num_pages=None, like=None):
        """An nsa.KVCache for this layer: `batch` sequences of up to `capacity` tokens, contiguous
        or paged, on the device and in the dtype of `like` (default: the layer's parameters)."""
        if like is None:
            w = self.q_proj.weight
            like = torch.empty(0, dtype=w.dtype, device=w.device)
        return nsa.KVCache(batch, self.num_kv_heads, self.head_dim, self.head_dim, capacity, self.config,
                           page_size=page_size, num_pages=num_pages, like=like, separate_kv=self.separate_kv)

    @torch.no_grad()
    def _cached(self, hidden, cache, q_lens):
        B, Tq, _ = hidden.shape
        HQ = self.num_heads
        if cache.batch != B:
            raise ValueError("cache holds %d sequences, hidden has B = %d" % (cache.batch, B))
        counts = [int(n) for n in q_lens] if q_lens is not None else [Tq] * B
        # positions after each sequence's cached tokens (rows past its count: any valid position)
        pos = torch.tensor(cache.lengths, device=hidden.device)[:, None] + torch.arange(Tq, device=hidden.device)
        q, k, v, kw = self._project(hidden, pos)
        cache.append(k, v, q_lens=counts, **kw)
        if self.learnable_compression:  # phi of the blocks the new tokens complete
            l, d = self.config.cmp_len, self.config.cmp_stride
            for b, first, stop in cache.completed(counts):
                kt, vt = cache.tokens(b, first * d, (stop - 1) * d + l)
                blocks = [x.unfold(0, l, d).permute(0, 1, 3, 2) for x in (kt, vt)]  # [n, H, l, D]
                cache.write_cmp(b, first, self.k_phi.compress_blocks(blocks[0]).to(kt.dtype),
                                self.v_phi.compress_blocks(blocks[1]).to(vt.dtype))
        g_cmp, g_slc, g_swa = torch.sigmoid(self.gate(hidden)).view(B, Tq, 3, HQ).unbind(2)
        o = cache.attend(q, q_lens=counts, g_cmp=g_cmp.contiguous(), g_slc=g_slc.contiguous(), g_swa=g_swa.contiguous(),
                         cmp_by_caller=self.learnable_compression)
        return self.o_proj(o.reshape(B, Tq, HQ * o.shape[-1]))

    def _project(self, hidden, pos):
        """q, k, v with RoPE at pos ([T] or [B, T]) and, with separate_kv, the branches' own K/V."""
        B, T, _ = hidden.shape
        HQ, H, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.rope(self.q_proj(hidden).view(B, T, HQ, D), pos)
        k = self.rope(self.k_proj(hidden).view(B, T, H, D), pos)
        v = self.v_proj(hidden).view(B, T, H, D)
        kw = {}
        if self.separate_kv:
            ks, vs = self.kv_slc_proj(hidden).view(B, T, 2, H, D).unbind(2)
            kw_, vw = self.kv_swa_proj(hidden).view(B, T, 2, H, D).unbind(2)
            kw.update(k_slc=self.rope(ks, pos), v_slc=vs, k_swa=self.rope(kw_, pos), v_swa=vw)
        return q, k, v, kw

    def forward(self, hidden, cu_seqlens=None, return_aux=False, cache=None, q_lens=None):
        if cache is not None:
            if cu_seqlens is not None or return_aux:
                raise ValueError("a cached step takes neither cu_seqlens nor return_aux")
            return self._cached(hidden, cache, q_lens)
        B, T, _ = hidden.shape
        HQ = self.num_heads
        pos = positions(T, cu_seqlens, hidden.device)
        q, k, v, kw = self._project(hidden, pos)
        k_cmp = v_cmp = None
        if self.learnable_compression:
            k_cmp, v_cmp = self.k_phi(k, cu_seqlens), self.v_phi(v, cu_seqlens)
        g_cmp, g_slc, g_swa = torch.sigmoid(self.gate(hidden)).view(B, T, 3, HQ).unbind(2)
        out = nsa.native_sparse_attention(q, k, v, g_cmp, g_slc, g_swa, config=self.config, k_cmp=k_cmp, v_cmp=v_cmp,
                                          cu_seqlens=cu_seqlens, return_aux=return_aux, **kw)
        o, aux = out if return_aux else (out, None)
        y = self.o_proj(o.reshape(B, T, HQ * o.shape[-1]))
        return (y, aux) if return_aux else y
