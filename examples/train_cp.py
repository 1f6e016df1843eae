#!/usr/bin/env python3
"""Training steps of a small NSA language model with context parallelism (nsa.distributed):
every rank holds its zigzag part of each sequence (nsa.distributed.shard), runs the model on it
(rotary positions from nsa.distributed.positions; the attention layer all-gathers K / V and
sends dK / dV back to their owners), adds its part of the next-token loss, and the parameter
gradients are summed over the ranks. Before training, rank 0 runs the same model on the whole
sequences in one process and checks that the loss and every parameter gradient agree with the
ranks' sum; then each step prints the loss and tokens/s.

    torchrun --nproc_per_node 2 examples/train_cp.py                      # GPUs: NCCL, bf16
    torchrun --nproc_per_node 3 examples/train_cp.py --device cpu --seq 600 --steps 3
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import nsa  # noqa: E402
import nsa.distributed as cp  # noqa: E402
from nsa.nn import RotaryEmbedding  # noqa: E402


class Layer(nn.Module):
    """Token embedding -> q / k / v / gate projections -> RoPE -> NSA -> output projection ->
    logits. attend(q, k, v, g_cmp, g_slc, g_swa) is the whole-sequence call or the
    context-parallel one."""

    def __init__(self, vocab, dim, hq, h, head_dim):
        super().__init__()
        self.hq, self.h, self.d = hq, h, head_dim
        self.emb = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, hq * head_dim, bias=False)
        self.kv = nn.Linear(dim, 2 * h * head_dim, bias=False)
        self.gates = nn.Linear(dim, 3 * hq)
        self.out = nn.Linear(hq * head_dim, dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.rope = RotaryEmbedding(head_dim)

    def forward(self, tokens, pos, attend):
        B, T = tokens.shape
        x = self.emb(tokens)
        q = self.rope(self.q(x).view(B, T, self.hq, self.d), pos)
        k, v = self.kv(x).view(B, T, 2, self.h, self.d).unbind(2)
        k = self.rope(k, pos)
        g = torch.sigmoid(self.gates(x)).view(B, T, 3, self.hq)
        o = attend(q, k, v, g[:, :, 0], g[:, :, 1], g[:, :, 2])
        return self.head(x + self.out(o.reshape(B, T, -1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=32768, help="tokens per sequence (split over the ranks)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = nsa.Config()  # the paper's: l = 32, d = 16, l' = 64, n = 16, w = 512
    vocab, T, B = 256, args.seq, args.batch

    torch.manual_seed(0)  # the same weights and data on every rank
    model = Layer(vocab, 256, 8, 2, 64).to(dev, dtype)
    data = torch.randint(0, vocab, (B, T + 1), device=dev)
    tokens, targets = data[:, :-1], data[:, 1:]
    my_tokens, my_targets = cp.shard(tokens, rank, world), cp.shard(targets, rank, world)
    my_pos = cp.positions(T, rank, world, device=dev)

    def cp_attend(q, k, v, g0, g1, g2):
        return cp.native_sparse_attention(q, k, v, g0, g1, g2, config=cfg, seq_len=T)

    def local_loss():
        logits = model(my_tokens, my_pos, cp_attend)
        # this rank's share of the mean over all B * T positions
        return F.cross_entropy(logits.float().reshape(-1, vocab), my_targets.reshape(-1), reduction="sum") / (B * T)

    def sum_grads():
        for p in model.parameters():
            dist.all_reduce(p.grad)

    # check against the whole sequences in one process
    loss = local_loss()
    loss.backward()
    sum_grads()
    total = loss.detach().clone()
    dist.all_reduce(total)
    if rank == 0:
        cp_grads = [p.grad.detach().clone() for p in model.parameters()]
        model.zero_grad()

        def whole_attend(q, k, v, g0, g1, g2):
            return nsa.native_sparse_attention(q, k, v, g0, g1, g2, config=cfg)

        logits = model(tokens, torch.arange(T, device=dev), whole_attend)
        whole = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        whole.backward()
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        worst = max(((a.float() - p.grad.float()).abs().max() / p.grad.float().abs().max().clamp_min(1e-12)).item()
                    for a, p in zip(cp_grads, model.parameters()))
        ok = abs(whole.item() - total.item()) <= tol * abs(whole.item()) and worst <= tol
        print("check: loss %.6f on %d ranks, %.6f in one process; largest relative gradient difference %.2e: %s"
              % (total.item(), world, whole.item(), worst, "ok" if ok else "MISMATCH"), flush=True)
        if not ok:
            dist.destroy_process_group()
            sys.exit(1)
    model.zero_grad()
    dist.barrier()

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = local_loss()
        loss.backward()
        sum_grads()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if rank == 0:
            print("step %d: loss %.4f, %.0f tokens/s over %d ranks" % (step, total.item(), B * T / dt, world), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
