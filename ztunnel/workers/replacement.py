"""`python -m ztunnel.workers.replacement <index> <fd> <parent pid>`: a worker that replaces one that
died, started by the supervisor as a new interpreter (`spawning.exec_worker`) with the proxy's
environment and the worker's end of its channel as `fd`.

It reads the configuration from that environment as the parent did, dies with the parent
(`PR_SET_PDEATHSIG`, and at once if the parent is already gone), and runs the worker body.
"""

from __future__ import annotations

import os
import signal
import sys

from ztunnel.allocator import tune_allocator
from ztunnel.config.settings import Config, ConfigError
from ztunnel.lifecycle import set_pdeathsig
from ztunnel.logs.lines import setup_logging
from ztunnel.workers.worker import run_worker


def main(argv: list[str]) -> int:
    index, fd, parent = (int(a) for a in argv)
    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:
        return 0
    try:
        config = Config.from_env(os.environ)
    except ConfigError as e:  # the parent read the same environment: a file changed since
        print(f"ztunnel: data-plane worker {index}: {e}", file=sys.stderr)
        return 1
    setup_logging(config.log_format, config.log_level)
    tune_allocator(os.environ)
    return run_worker(config, index, fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
