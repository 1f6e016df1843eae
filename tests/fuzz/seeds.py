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
for op in list(range(14)) + [0xFF, 0xFE]:  # 0xFF: the inference step, 0xFE: the dense step
    for k in range(4):
        head = bytes([op, rng.randrange(256)]) + bytes(rng.randrange(256) for _ in range(8))
        # bytes below 170 keep a tensor plain; about half the rest perturb something
        body = bytes(rng.randrange(170) if rng.random() < 0.5 else rng.randrange(256) for _ in range(120))
        with open(os.path.join(out, f"seed_{op:02d}_{k}"), "wb") as f:
            f.write(head + body)
