"""The proxy's allocator settings: relay-sized buffers allocated and freed over and over stay in the
heap instead of being mapped, zeroed and unmapped each time (seen as page faults)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# Allocates and frees 2 MiB blocks (the size of a large TLS write) 400 times, after one warm-up
# round; prints whether the tuning took and the minor page faults of the 400.
_CHURN = """
import json, resource, sys
from ztunnel.app import tune_allocator
tuned = tune_allocator(json.loads(sys.argv[1]))
def cycle():
    keep = [bytes(bytearray(2 << 20)) for _ in range(4)]
    del keep
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):
    cycle()
print(json.dumps([tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before]))
"""


def _churn(environ: str) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", _CHURN, environ], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    tuned, faults = json.loads(out)
    return tuned, faults


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_tuned_allocator_reuses_large_blocks_without_page_faults() -> None:
    tuned, faults = _churn("{}")
    assert tuned
    # Untuned, each 2 MiB block is faulted in page by page: 512 faults a block, ~200,000 here.
    untuned_ok, untuned_faults = _churn('{"MALLOC_TRIM_THRESHOLD_": "131072"}')
    assert not untuned_ok  # the operator's glibc variable wins: nothing is set
    assert untuned_faults > 100_000
    assert faults < untuned_faults // 100
