"""`ztunnel proxy`'s start: configuration in, the process tuned, then the supervisor and its workers.

The configuration is read from the environment, logging set up, the fd limit raised and glibc's
allocator tuned. Then the order is what the processes' memory is made of: the worker body and what
it imports are loaded, the fork server is forked (before any event loop or gRPC thread), and only
then does this process import the control side (the supervisor, the control runtime, the admin and
metrics servers, the local file's YAML, gRPC when a control plane is used), which so never exists
in a worker's memory. The supervisor runs until it is stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
import resource
from collections.abc import Mapping

import uvloop

from ztunnel.config import Config, ConfigError
from ztunnel.logs import setup_logging
from ztunnel.startup import StartupError
from ztunnel.workers.forkserver import ForkServer, start_fork_server


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# glibc's allocator, left to itself, maps each block above an adaptive threshold on its own and
# returns the top of the heap to the kernel once more than twice that is free there. A relay's
# buffers (a TLS write of a few hundred KiB, a payload copied out of a read) are allocated and freed
# on every read, so that adaptive pair ends up mapping, zeroing and unmapping them again and again:
# measured at up to ~175,000 page faults per GiB relayed by the sending proxy, ~15 % of its CPU.
# Fixed thresholds keep blocks up to MALLOC_MMAP_THRESHOLD in the heap and up to
# MALLOC_TRIM_THRESHOLD of free heap for reuse. The glibc environment variables of the same names
# (with a trailing underscore) or GLIBC_TUNABLES win when set.
MALLOC_MMAP_THRESHOLD = 4 << 20
MALLOC_TRIM_THRESHOLD = 16 << 20
_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def tune_allocator(environ: Mapping[str, str]) -> bool:
    """Fix glibc's mmap and trim thresholds for this process and the ones it forks; True if set."""
    if any(k in environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
        and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
    )


def run_proxy(environ: dict[str, str]) -> int:
    try:
        config = Config.from_env(environ)
    except ConfigError as e:
        raise StartupError(str(e)) from None
    setup_logging(config.log_format, config.log_level)
    raise_fd_limit()
    tune_allocator(environ)
    return run_supervisor(config)


def start_data_plane(config: Config) -> ForkServer:
    """The fork server of the workers, forked with the worker body and its imports loaded and
    nothing of the control side."""
    from ztunnel.workers.worker import preload, run_worker

    preload(config)
    return start_fork_server(functools.partial(run_worker, config))


def run_supervisor(config: Config) -> int:
    """One supervisor and `worker_threads` data-plane worker processes, in both modes."""
    fork_server = start_data_plane(config)
    try:
        from ztunnel.workers.supervisor import Supervisor  # the control side, after the fork

        async def main() -> int:
            return await Supervisor(config, fork_server).run()

        return uvloop.run(main())
    finally:
        fork_server.close()  # the fork server exits when its channel closes
