"""The tests' one process harness: `ztunnel proxy`, `ztunnel control-plane` and `ztunnel cni-agent`
started as a deployment starts them and observed as a user observes them. Every test that runs one
of these processes does it through this module, the tests' layer over the shipped one the demo and
the benches use too (`ztunnel/harness.py`: `Process`, `ControlPlane`, `NodeAgent`, and `Proxy`'s
base `ProxyProcess`); what it adds is the fleet a test's fixture stops, the scrape's parsed samples
and a dedicated proxy's test settings.

How a process starts: the shipped entry point (the `ztunnel` console script beside this Python),
optionally inside a network namespace (`netns=`: `ip netns exec NAME ztunnel ...`) and under a
wrapper that ends by exec'ing its arguments (`wrap=`: e.g. `unshare -m sh -c '...; exec "$@"'`),
in its own session and process group, stdin closed, stdout and stderr appended to one log file
(or, `output=`, to a descriptor the test holds), and a clean environment: this test process's
environment without any proxy setting (`ZTUNNEL_*`, `PROXY_*`, `XDS_*`, `CA_*`, `LOCAL_XDS*`,
`INPOD_*`) nor log setting (`LOG_*`, `RUST_LOG`), plus what the test passes. How it stops: SIGTERM
to its first process (a drain), then SIGKILL to its whole process group until none of it is left.

The API is blocking (from an async test whose loop also serves what the proxy talks to, use the
async face):

* `Fleet(log_dir)` (fixtures `fleet` and `module_fleet`, conftest.py): what a test starts, each
  stopped by `close()`, its log's tail printed.
  - `fleet.proxy(env, netns=, wrap=, output=) -> Proxy`, not started;
  - `fleet.start_all(env, ...)` / `await fleet.start(env, ...)`: proxies booting in parallel, each
    waited ready;
  - `fleet.control_plane(directory, host, yaml_text, *args, port=0, netns=) -> ControlPlane`,
    started (`yaml_text` None: the source is in `args`, e.g. `--kube DIR`);
  - `fleet.adopt(process)`: any `Process` made by hand (a `NodeAgent`, say), stopped with the rest.
* `Process`, the base: `spawn()`, `wait_ready(timeout)`, `start(timeout)` (both), `running()`,
  `pid`, `returncode`, `send(sig)`, `wait_exit()`, `terminate(sig)`, `kill()` (the whole group),
  `stop()`, `pids()` (the first process, then the live members of its group: workers, a certificate
  helper; neither a zombie nor one exiting, its command line gone), `exiting()` (those leaving),
  `log()`, `tail()`, `mark()` and `log_since_mark()`.
* `Proxy(env, log_path, netns=)`: its addresses from its env (`admin`, `stats`, `readiness`,
  `socks5`); `get(port_name, path)` (in a namespace: curl run there), `ready()`,
  `readiness_answer()`, `config_dump()`, `worker_entries()` (`/config_dump`'s workers),
  `metrics_text()`, `samples()`, `metric(name, **labels)`, `listeners()` (its "proxy ready" log
  line), `workers()` and `cert_helpers()` (process ids), `quit()` (POST /quitquitquit),
  `restart()`.
* `ControlPlane(directory, listen, yaml_text, *args, netns=)`: `address`, `url`, `root` (its root
  certificate), `wire(env)` (a proxy's env fed by it), `push(yaml)`, `streams_opened(node)`,
  `certificates_issued(identity)`; ready once it logged its root certificate.
* `NodeAgent(log_path, zds_socket, cni_socket, args, env, netns=)`: ready once its CNI socket
  accepts connections.
* The async face, each a thread running the blocking call: `astart`, `await_ready`, `await_exit`,
  `aterminate`, `astop`, `akill`; on a proxy `aconfig_dump`, `asamples`, `ametric`;
  `await fleet.start(...)`.
* `proxy_env(ip, workload, local_xds, **extra)`: a dedicated proxy's settings, every port on `ip`;
  `clean_env(env)`: what a process gets.

What /proc says of processes is `tests/procs.py`; what the processes carry traffic for (echo apps,
SOCKS5 clients, mesh YAML, `http`) is `tests/apps.py`; waiting for a condition is
`tests/waiting.py`.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.apps import free_port
from ztunnel.harness import ZTUNNEL, ControlPlane, NodeAgent, Process, ProxyProcess, clean_env
from ztunnel.harness import ProcessExited as ProxyExited

__all__ = [
    "ZTUNNEL",
    "ControlPlane",
    "Fleet",
    "NodeAgent",
    "Process",
    "Proxy",
    "ProxyExited",
    "Samples",
    "clean_env",
    "proxy_env",
]

Samples = list[tuple[str, dict[str, str], float]]


def proxy_env(
    ip: str, workload: str = "demo/client/client", local_xds: str = "", **extra: str
) -> dict[str, str]:
    """A dedicated proxy for `workload` (`namespace/name/serviceaccount`), every port on `ip`, the
    SOCKS5 listener on, two data-plane workers as deployed, certificates from the fake CA and
    workloads from `local_xds` (a config's text or path; empty: none). `extra` overrides."""
    env = {
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": workload,
        "XDS_ADDRESS": "",
        "FAKE_CA": "true",
        "LOCAL_XDS": local_xds,
        "PROXY_BIND_ADDRESS": ip,
        "UNSTABLE_ENABLE_SOCKS5": "true",
        "SOCKS5_ADDRESS": f"{ip}:15080",
        "ADMIN_ADDRESS": f"{ip}:15000",
        "STATS_ADDRESS": f"{ip}:15020",
        "READINESS_ADDRESS": f"{ip}:15021",
        "CONNECTION_TERMINATION_DEADLINE": "1s",
        "ZTUNNEL_WORKER_THREADS": "2",
    }
    env.update(extra)
    return env


class Proxy(ProxyProcess):
    """`ztunnel proxy` as the tests observe it: `ProxyProcess`, and `/metrics` parsed as a scraper
    parses it."""

    def samples(self) -> Samples:
        """Every sample of `/metrics`, parsed, as (name as exposed, labels, value)."""
        return [
            (s.name, s.labels, s.value)
            for family in text_string_to_metric_families(self.metrics_text())
            for s in family.samples
        ]

    def metric(self, name: str, *, since: Samples | None = None, **labels: str) -> float:
        """Sum of the samples of `name` (`..._total` for a counter) whose labels include `labels`;
        `since`: minus that sum in an earlier `samples()`."""

        def total(samples: Samples) -> float:
            return sum(
                v for n, have, v in samples if n == name and all(have.get(k) == w for k, w in labels.items())
            )

        return total(self.samples()) - (total(since) if since is not None else 0.0)

    async def asamples(self) -> Samples:
        return await asyncio.to_thread(self.samples)

    async def ametric(self, name: str, *, since: Samples | None = None, **labels: str) -> float:
        return await asyncio.to_thread(lambda: self.metric(name, since=since, **labels))


class Fleet:
    """The processes a test (or module) starts; `close()`, the fixture's teardown, stops each (the
    proxies first), kills its whole process group, and prints each one's log tail."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[Process] = []

    @property
    def proxies(self) -> list[Proxy]:
        return [p for p in self.processes if isinstance(p, Proxy)]

    def _log(self, kind: str) -> Path:
        return self.log_dir / f"{kind}-{len(self.processes)}.log"

    def adopt(self, process: Process) -> Any:
        """Have `close()` stop `process` too; `process` itself."""
        self.processes.append(process)
        return process

    def proxy(
        self,
        env: Mapping[str, str],
        *,
        netns: str | None = None,
        wrap: Sequence[str] = (),
        output: int | None = None,
    ) -> Proxy:
        """A proxy of this fleet, not started (`output`: a file descriptor for its stdout and stderr
        instead of its log file, e.g. a pipe the test holds)."""
        proxy: Proxy = self.adopt(Proxy(env, self._log("proxy"), netns=netns, wrap=wrap, output=output))
        return proxy

    def start_all(self, *envs: Mapping[str, str], netns: str | None = None) -> list[Proxy]:
        """Start several at once (they boot in parallel) and wait until each is ready."""
        proxies = [self.proxy(env, netns=netns) for env in envs]
        for proxy in proxies:
            proxy.spawn()
        for proxy in proxies:
            proxy.wait_ready()
        return proxies

    async def start(self, *envs: Mapping[str, str], netns: str | None = None) -> list[Proxy]:
        """`start_all` from an async test (the loop keeps running meanwhile)."""
        return await asyncio.to_thread(lambda: self.start_all(*envs, netns=netns))

    def control_plane(
        self,
        directory: Path,
        host: str,
        text: str | None,
        *args: str,
        port: int = 0,
        netns: str | None = None,
    ) -> ControlPlane:
        """A control plane serving `text` on `host` (`port` 0: a free one) with further options
        `args` (e.g. `--tls`), started."""
        listen = f"{host}:{port or free_port(host)}"
        cp: ControlPlane = self.adopt(ControlPlane(directory, listen, text, *args, netns=netns))
        cp.start()
        return cp

    def close(self) -> None:
        """Stop every process (once: a second call finds none)."""
        order = self.proxies + [p for p in self.processes if not isinstance(p, Proxy)]
        self.processes = []
        try:
            for process in order:
                process.send(signal.SIGTERM)
            for process in order:
                process.stop()
        finally:
            for process in order:
                sys.stdout.write(f"--- {process.name} log, tail ---\n{process.tail(6000)}\n")
