"""`ztunnel proxy`'s start: configuration in, the process tuned, then the supervisor and its workers.

The configuration is read from the environment, logging set up, the fd limit raised and glibc's
allocator tuned. Then the order is what the processes' memory is made of: the worker body and what
it imports are loaded, OpenSSL's tables filled (`hbone.tlswarm`), the workers are forked (before
any event loop or thread), and only then does this process import the control side (the
supervisor, the control runtime, the admin and metrics servers, the local file's YAML, protobuf
and our gRPC client when a control plane is used), which so never exists in a worker's memory. The
supervisor runs until it is stopped.
"""

from __future__ import annotations

import contextlib
import functools
import resource
from collections.abc import Mapping

import uvloop

from ztunnel.allocator import tune_allocator
from ztunnel.config.settings import Config, ConfigError
from ztunnel.logs.lines import setup_logging
from ztunnel.startup import StartupError
from ztunnel.workers.spawning import Spawner, fork_workers


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_proxy(environ: dict[str, str]) -> int:
    try:
        config = Config.from_env(environ)
    except ConfigError as e:
        raise StartupError(str(e)) from None
    setup_logging(config.log_format, config.log_level)
    raise_fd_limit()
    tune_allocator(environ)
    return run_supervisor(config, environ)


def start_data_plane(config: Config, environ: Mapping[str, str]) -> Spawner:
    """The workers, forked with the worker body and its imports loaded and nothing of the control
    side; replacements are new interpreters given `environ`."""
    from hbone.tlswarm import warm_up
    from ztunnel.workers.worker import preload, run_worker

    warm_up()  # OpenSSL's tables, built once here and shared by every worker forked below
    preload(config)
    first = fork_workers(functools.partial(run_worker, config), max(1, config.worker_threads))
    return Spawner(first, environ)


def run_supervisor(config: Config, environ: Mapping[str, str]) -> int:
    """One supervisor and `worker_threads` data-plane worker processes, in both modes."""
    spawner = start_data_plane(config, environ)
    try:
        from ztunnel.workers.supervisor import Supervisor  # the control side, after the fork

        async def main() -> int:
            return await Supervisor(config, spawner).run()

        return uvloop.run(main())
    finally:
        spawner.close()  # workers forked but never started (start-up failed first)
