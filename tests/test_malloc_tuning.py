"""`--keep-freed-memory` (embedserve/engine/malloc_tuning.py): glibc's malloc keeps a batch's freed
activations in the process instead of trimming and re-faulting them on every batch."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from embedserve.engine import malloc_tuning

# a forward pass's shape of memory, on an engine-like thread: eight 18-25 MB blocks of sizes that
# change every round (as row-bucketed batches do), all freed at the round's end; minor page faults
# per round once warm
PROBE = r"""
import json, resource, sys, threading
import torch
from embedserve.engine import malloc_tuning
why = malloc_tuning.keep_freed_memory() if sys.argv[1] == "1" else "off"
out = {"why": why}
def rounds(n):
    for i in range(n):
        blocks = [torch.ones(3000 + 37 * i + 100 * k, 1536) for k in range(8)]
        del blocks
def work():
    rounds(12)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rounds(12)
    out["faults_per_round"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 12
t = threading.Thread(target=work); t.start(); t.join()
print(json.dumps(out))
"""


def _probe(on: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in malloc_tuning.USER_VARS and k != "GLIBC_TUNABLES"}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-c", PROBE, "1" if on else "0"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="mallopt is glibc's")
def test_freed_batch_memory_stays_in_the_process():
    on, off = _probe(True), _probe(False)
    assert on["why"] is None
    # glibc's defaults trim the freed top and map big blocks afresh: thousands of faults a round
    assert off["faults_per_round"] > 1000
    assert on["faults_per_round"] < off["faults_per_round"] / 2


def test_the_environments_own_malloc_settings_are_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert "MALLOC_ARENA_MAX" in malloc_tuning.keep_freed_memory()
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")
    assert "GLIBC_TUNABLES" in malloc_tuning.keep_freed_memory()


def test_the_switch_is_a_compute_path(monkeypatch):
    from kernels import compute
    assert compute.ComputePaths().keep_freed_memory is True
    monkeypatch.setenv("EMBEDSERVE_KEEP_FREED_MEMORY", "0")
    assert compute.ComputePaths.from_env().keep_freed_memory is False
