"""bench/peers.py (the side-by-side GPU harness) keeps its pure parts working here:
FLOP counts, rows, ratios, the table, the JSON round trip (and the PNG when matplotlib is
installed), through its own --self-test. The GPU parts run only on a GPU machine."""
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_peers_harness_self_test():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers.py"), "--self-test"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 failed" in r.stdout, r.stdout
