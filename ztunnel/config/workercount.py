"""How many data-plane workers `ztunnel proxy` runs, from the CPUs it may use (as the reference)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable

from ztunnel.config.envvars import Env, int_parser

_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(m?)")


def parse_cpu_quantity(value: str) -> int:
    """A Kubernetes CPU quantity (`2`, `1.5`, `500m`), rounded up to whole CPUs."""
    m = _QUANTITY.fullmatch(value.strip())
    if m is None:
        raise ValueError("expected a CPU quantity such as 2, 1.5 or 500m")
    cpus = float(m.group(1)) / (1000.0 if m.group(2) else 1.0)
    return max(1, math.ceil(cpus))


def _worker_threads_parser(cpus: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        text = value.strip()
        if text.endswith("%"):
            pct = text[:-1]
            if not pct.isdigit() or not 0 < int(pct) <= 100:
                raise ValueError("expected an integer, N% (1-100) or 0")
            return max(1, math.ceil(cpus * int(pct) / 100))
        if not text.isdigit():
            raise ValueError("expected an integer, N% (1-100) or 0")
        n = int(text)
        return cpus if n == 0 else n

    return parse


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def worker_count(env: Env, concurrency: int | None) -> int:
    """`ZTUNNEL_WORKER_THREADS`, else `PROXY_CONFIG.concurrency`, else from the CPU limit and request."""
    limit = env.parse("ZTUNNEL_RESOURCE_CPU_LIMIT", parse_cpu_quantity, None)
    request = env.parse("ZTUNNEL_RESOURCE_CPU_REQUEST", parse_cpu_quantity, None)
    # Istio's chart sets ZTUNNEL_CPU_LIMIT from the container's CPU limit, `0` when it has none.
    cpus = limit or env.parse("ZTUNNEL_CPU_LIMIT", int_parser(0), None) or _available_cpus()
    threads = env.parse("ZTUNNEL_WORKER_THREADS", _worker_threads_parser(cpus), None)
    if threads is None and concurrency is not None:
        threads = cpus if concurrency == 0 else concurrency
    if threads is None:
        if limit is not None:
            threads = max(limit, request or 0)
        else:
            threads = max(math.ceil(cpus * 0.25), request or 0, 2)
    return max(1, threads)
