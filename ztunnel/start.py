"""`ztunnel proxy`'s start: configuration in, the process tuned, then the supervisor and its workers.

The configuration is read from the environment, logging set up, the fd limit raised and glibc's
allocator tuned. Then the order is what the processes' memory is made of: everything this process
and its workers will run is imported first (the worker body and what its workers load, then the
control side: the supervisor, the control runtime, the admin and metrics servers, the local file's
YAML, protobuf and our gRPC client when a control plane is used), OpenSSL's tables are filled
(`hbone.tlswarm`), and the workers are forked (before any event loop or thread). Every process
shares that memory copy-on-write; the workers never run the control side, so its pages stay shared,
and this process does not copy the shared pages by importing after the fork (an import writes to
the reference counts of much of what is already loaded: the control side imported after the fork
cost the proxy about 1 MiB more at rest). The supervisor runs until it is stopped.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import resource
from collections.abc import Mapping

import uvloop

from ztunnel.allocator import tune_allocator
from ztunnel.config.settings import Config, ConfigError
from ztunnel.lifecycle import StartupError
from ztunnel.logs.lines import setup_logging
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
    if config.compliance_policy:
        logging.getLogger("ztunnel.config").warning(
            "COMPLIANCE_POLICY=%s is not enforced: pqc is the only policy that changes this proxy's TLS "
            "(and it is refused); HBONE and the control plane's connections run as with no policy",
            config.compliance_policy,
        )
    raise_fd_limit()
    tune_allocator(environ)
    return run_supervisor(config, environ)


def start_data_plane(config: Config, environ: Mapping[str, str]) -> Spawner:
    """The workers, forked with the worker body, its imports and the control side's loaded;
    replacements are new interpreters given `environ`."""
    from hbone.tlswarm import warm_up
    from ztunnel.control import control_imports
    from ztunnel.workers.worker import preload, run_worker

    # In this order (the workers' modules, the control side's, then OpenSSL's tables) the shared memory is
    # laid out so that the processes write into fewest of its pages: 0.7 MiB less for the proxy at
    # rest than the control side first and OpenSSL's tables before the DNS server's modules.
    preload(config)
    for name in control_imports(config):
        importlib.import_module(name)
    warm_up()  # OpenSSL's tables, built once here and shared by every worker forked below
    first = fork_workers(functools.partial(run_worker, config), max(1, config.worker_threads))
    return Spawner(first, environ)


def run_supervisor(config: Config, environ: Mapping[str, str]) -> int:
    """One supervisor and `worker_threads` data-plane worker processes, in both modes."""
    from ztunnel.workers.supervisor import Supervisor

    spawner = start_data_plane(config, environ)
    try:

        async def main() -> int:
            return await Supervisor(config, spawner).run()

        return uvloop.run(main())
    finally:
        spawner.close()  # workers forked but never started (start-up failed first)
