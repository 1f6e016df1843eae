#!/usr/bin/env python3
"""Writes seed inputs for build/nsa_fuzz: four per op (the first byte picks the op), mostly
unperturbed choices so the seeds reach the kernels. Usage: seeds.py OUTDIR; `make fuzz`'s corpus
tests/fuzz/corpus is these seeds minimised with libFuzzer's -merge=1."""
import os
import random
import sys

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = random.Random(1)
EXPRS = ["q_idx >= kv_idx && doc[q_idx] == doc[kv_idx]", "score + bias[h, q_idx - kv_idx + 5] * 2",
         "where(q_idx // 3 % 2 == 0, tanh(score), -score) - abs(kv_idx - q_idx) / 7", "(b & 1) == 0 | ~(h < 2)"]
for k, e in enumerate(EXPRS):  # 0xFD: a mod expression (pres bit 0: a score_mod)
    with open(os.path.join(out, f"seed_253_{k}"), "wb") as f:
        f.write(bytes([0xFD, 1 if "score" in e else 0]) + bytes(8) + e.encode())
for op in list(range(14)) + [0xFF, 0xFE, 0xFC, 0xFB]:  # the steps, block-sparse attention fwd / bwd
    for k in range(4):
        head = bytes([op, rng.randrange(256)]) + bytes(rng.randrange(256) for _ in range(8))
        # bytes below 170 keep a tensor plain; about half the rest perturb something
        body = bytes(rng.randrange(170) if rng.random() < 0.5 else rng.randrange(256) for _ in range(120))
        with open(os.path.join(out, f"seed_{op:02d}_{k}"), "wb") as f:
            f.write(head + body)
for k in range(14):  # 0xFA: a query chunk; the second byte picks the NSA op
    head = bytes([0xFA, k % 7, rng.randrange(256)]) + bytes(rng.randrange(256) for _ in range(8))
    body = bytes(rng.randrange(170) if rng.random() < 0.5 else rng.randrange(256) for _ in range(120))
    with open(os.path.join(out, f"seed_250_{k}"), "wb") as f:
        f.write(head + body)
