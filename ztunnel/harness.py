"""The processes of the project started as a deployment starts them, observed as a user observes
them and stopped by process group: the one process control of `ztunnel demo`, of the tests (their
layer over it is `tests/harness.py`) and of the benches' topologies.

How a process starts: a command (the shipped entry point, the `ztunnel` console script beside this
Python, unless told another), optionally inside a network namespace (`netns=`: `ip netns exec NAME
...`) and under a wrapper that ends by exec'ing its arguments (`wrap=`), in its own session and
process group, stdin closed, stdout and stderr appended to one log file (or, `output=`, to a
descriptor the caller holds). `clean_env` is the environment of a ztunnel started so: this
process's environment without any proxy or log setting, plus what the caller passes. How it stops:
SIGTERM to its first process (a drain), then SIGKILL to its whole process group until none of it
is left.

* `Process`: `spawn()`, `wait_ready(timeout)`, `start(timeout)` (both), `running()`, `pid`,
  `returncode`, `send(sig)`, `wait_exit()`, `terminate(sig)`, `kill()` (the whole group), `stop()`,
  `pids()` (the first process, then the live members of its group), `exiting()`, `log()`,
  `tail()`, `mark()` and `log_since_mark()`; and their async twins (`astart`, `await_ready`,
  `await_exit`, `aterminate`, `astop`, `akill`), each a thread running the blocking call.
* `ProxyProcess(env, log_path)`: `ztunnel proxy`, its addresses from its env; `get(port_name, path)`
  (in a namespace: curl run there), `ready()`, `readiness_answer()`, `quit()`, `config_dump()`,
  `worker_entries()`, `metrics_text()`, `listeners()`, `workers()`, `cert_helpers()`, `restart()`.
* `ControlPlane(directory, listen, yaml_text, *args)`: `ztunnel control-plane`; ready once it logged
  its root certificate.
* `NodeAgent(log_path, zds_socket, cni_socket, args, env)`: `ztunnel cni-agent`; ready once its CNI
  socket accepts connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _entry_point() -> list[str]:
    # As installed (the node image and the chart run it by this name); from a source tree without
    # the console script, the same module run by this Python.
    script = Path(sys.executable).parent / "ztunnel"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ztunnel"]


ZTUNNEL = _entry_point()

# What this process's own environment must not hand a ztunnel it starts.
NOT_INHERITED = (
    "ZTUNNEL_", "PROXY_", "XDS_", "CA_", "LOCAL_XDS", "INPOD_", "LOG_", "RUST_LOG", "POOL_", "HTTP2_",
    "FAKE_CA",
)  # fmt: skip


class ProcessExited(Exception):
    """A process ended when it should have been serving (or never became ready)."""


def clean_env(env: Mapping[str, str] = {}) -> dict[str, str]:
    """This process's environment without proxy or log settings, plus `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(NOT_INHERITED)}
    return {**base, **env}


def http(method: str, url: str, body: bytes | None = None, timeout: float = 10) -> tuple[int, bytes]:
    """One plain HTTP request; (status, body), an error status included."""
    data = body if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


# --- what /proc says of a process group ---------------------------------------------------------


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cmdline(pid: int) -> list[str]:
    """`pid`'s command line; empty for a process exiting (its memory already released) or gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` that still run: neither a zombie nor one exiting."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = _stat(int(entry))
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X") and cmdline(int(entry)):
            found.append(int(entry))
    return found


def group_left(pgid: int) -> list[int]:
    """Whatever of group `pgid` the kernel still lists but zombies (an exiting one counts here)."""
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                fields = _stat(int(entry))
                if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                    left.append(int(entry))
    return left


def is_cert_helper(pid: int) -> bool:
    """Whether `pid` is a proxy's certificate helper (`python -m ztunnel.identity.certwork`)."""
    return "ztunnel.identity.certwork" in cmdline(pid)


def _address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


# --- processes ----------------------------------------------------------------------------------


class Process:
    """One process (`args`: its arguments, after `command`, by default the ztunnel entry point, so
    its subcommand and options) in its own process group, with `env` as its whole environment."""

    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        *,
        netns: str | None = None,
        wrap: Sequence[str] = (),
        name: str = "",
        output: int | None = None,
        command: Sequence[str] = ZTUNNEL,
    ) -> None:
        self.args = list(args)
        self.command = list(command)
        self.wrap = list(wrap)
        self.output = output
        self.env = dict(env)
        self.log_path = log_path
        self.netns = netns
        self.name = name or (self.args[0] if self.args else Path(self.command[0]).name)
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log_offset = 0

    # --- life cycle ---------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the process (not waiting until it is ready)."""
        assert not self.running(), f"{self.name} already running"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        with open(self.log_path, "ab") as log:
            out = log.fileno() if self.output is None else self.output
            self.process = subprocess.Popen(
                [*prefix, *self.wrap, *self.command, *self.args],
                env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
            )  # fmt: skip
        self.starts += 1

    def is_ready(self) -> bool:
        """Whether the process serves (each kind says how it tells)."""
        return True

    def wait_ready(self, timeout: float = 30) -> None:
        """Until `is_ready()`; ProcessExited if the process ends first, or at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.process is not None, f"{self.name} never started"
            if self.process.poll() is not None:
                raise ProcessExited(f"{self.name} exited {self.process.returncode}:\n{self.tail()}")
            try:
                if self.is_ready():
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ProcessExited(f"{self.name} not ready after {timeout:g}s:\n{self.tail()}")
            time.sleep(0.05)

    def start(self, timeout: float = 30) -> Any:
        """`spawn()` then `wait_ready()`; the process itself."""
        self.spawn()
        self.wait_ready(timeout)
        return self

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} never started"
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def wait_exit(self, timeout: float = 20) -> int:
        """The first process's exit status, once it exited."""
        assert self.process is not None, f"{self.name} never started"
        return self.process.wait(timeout)

    def send(self, sig: int) -> None:
        """Send `sig` to the first process (the supervisor), if it runs."""
        if self.running():
            assert self.process is not None
            self.process.send_signal(sig)

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        """Signal the first process (SIGTERM: drain) and wait for its exit status."""
        self.send(sig)
        return self.wait_exit(timeout)

    def kill(self) -> None:
        """SIGKILL what is left of the process group; wait until none of it remains."""
        if self.process is None:
            return
        pgid = self.process.pid
        deadline = time.monotonic() + 10
        while self.process.poll() is None or group_left(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise ProcessExited(f"processes {group_left(pgid)} of {self.name} outlive SIGKILL")
            time.sleep(0.02)

    def stop(self, timeout: float = 10) -> int | None:
        """SIGTERM (a drain), then SIGKILL to whatever of the group is left; the exit status."""
        self.send(signal.SIGTERM)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        self.kill()
        return self.returncode

    def pids(self) -> list[int]:
        """The live processes of the group, the first process (the supervisor) first."""
        if self.process is None:
            return []
        first = self.process.pid
        return sorted(group_members(first), key=lambda p: (p != first, p))

    def exiting(self) -> list[int]:
        """Members of the group on their way out: listed by the kernel, their memory already gone."""
        if self.process is None:
            return []
        return sorted(set(group_left(self.process.pid)) - set(group_members(self.process.pid)))

    # --- its output ---------------------------------------------------------------------------

    def log(self) -> str:
        """Everything the process wrote (every start of it), as a user reading its output sees it."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def mark(self) -> None:
        """Make `log_since_mark` start from here."""
        self._log_offset = len(self.log())

    def log_since_mark(self) -> str:
        return self.log()[self._log_offset :]

    def tail(self, chars: int = 4000) -> str:
        return self.log()[-chars:]

    # --- the async face -----------------------------------------------------------------------

    async def astart(self, timeout: float = 30) -> Any:
        return await asyncio.to_thread(self.start, timeout)

    async def await_ready(self, timeout: float = 30) -> None:
        await asyncio.to_thread(self.wait_ready, timeout)

    async def await_exit(self, timeout: float = 20) -> int:
        return await asyncio.to_thread(self.wait_exit, timeout)

    async def aterminate(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        return await asyncio.to_thread(self.terminate, sig, timeout)

    async def astop(self, timeout: float = 10) -> int | None:
        return await asyncio.to_thread(self.stop, timeout)

    async def akill(self) -> None:
        await asyncio.to_thread(self.kill)


class ProxyProcess(Process):
    """`ztunnel proxy`: a supervisor and its data-plane workers. Its addresses come from its env
    (`env`: its settings, over `clean_env`)."""

    def __init__(
        self,
        env: Mapping[str, str],
        log_path: Path,
        *,
        netns: str | None = None,
        wrap: Sequence[str] = (),
        output: int | None = None,
        name: str = "",
    ) -> None:
        name = name or env.get("PROXY_WORKLOAD_INFO", "").rpartition("/")[2] or "proxy"
        super().__init__(
            ["proxy"], clean_env(env), log_path, netns=netns, wrap=wrap, name=name, output=output
        )

    @property
    def ip(self) -> str:
        return self.env.get("PROXY_BIND_ADDRESS", "127.0.0.1")

    def _where(self, var: str, port: int) -> tuple[str, int]:
        host, number = _address(self.env[var]) if self.env.get(var) else (self.ip, port)
        return ("127.0.0.1" if host in ("0.0.0.0", "") else host), number

    @property
    def socks5(self) -> tuple[str, int]:
        return self._where("SOCKS5_ADDRESS", 15080)

    @property
    def admin(self) -> tuple[str, int]:
        return self._where("ADMIN_ADDRESS", 15000)

    @property
    def stats(self) -> tuple[str, int]:
        return self._where("STATS_ADDRESS", 15020)

    @property
    def readiness(self) -> tuple[str, int]:
        return self._where("READINESS_ADDRESS", 15021)

    def is_ready(self) -> bool:
        return self.get("readiness", "/healthz/ready", timeout=2) == (200, b"ready\n")

    def ready(self) -> bool:
        """Whether `/healthz/ready` answers 200 now (no answer: not ready)."""
        try:
            return self.get("readiness", "/healthz/ready", timeout=2)[0] == 200
        except OSError:
            return False

    def readiness_answer(self) -> tuple[int, str]:
        """`/healthz/ready`'s (status, body) now; (0, the error) when nothing answers."""
        try:
            status, body = self.get("readiness", "/healthz/ready", timeout=5)
        except OSError as e:
            return 0, str(e)
        return status, body.decode(errors="replace")

    def quit(self, timeout: float = 20) -> int:
        """POST /quitquitquit, as an operator asks for a drain; the exit status."""
        status, body = self.get("admin", "/quitquitquit", method="POST")
        if status != 200:
            raise ProcessExited(f"{self.name}: /quitquitquit answered {status}: {body!r}")
        return self.wait_exit(timeout)

    def restart(self) -> None:
        self.terminate()
        self.kill()
        self.start()

    def workers(self) -> list[int]:
        """The data-plane workers' process ids (neither the supervisor nor a certificate helper)."""
        return [p for p in self.pids()[1:] if not is_cert_helper(p)]

    def cert_helpers(self) -> list[int]:
        """The certificate helpers running now (none once they lingered out)."""
        return [p for p in self.pids()[1:] if is_cert_helper(p)]

    # --- what a user sees ---------------------------------------------------------------------

    def get(self, port: str, path: str, *, method: str = "GET", timeout: float = 10) -> tuple[int, bytes]:
        """`port`: admin, stats or readiness. In a namespace, through curl run in it."""
        host, number = getattr(self, port)
        if self.netns is None:
            return http(method, f"http://{host}:{number}{path}", timeout=timeout)
        done = subprocess.run(
            ["ip", "netns", "exec", self.netns, "curl", "-s", "-X", method, "-m", f"{timeout:g}",
             "-w", "\n%{http_code}", f"http://{host}:{number}{path}"],
            capture_output=True, timeout=timeout + 10,
        )  # fmt: skip
        body, _, code = done.stdout.rpartition(b"\n")
        if not code or code == b"000":
            raise ConnectionError(f"no answer from {host}:{number}{path} in {self.netns}")
        return int(code), body

    def config_dump(self) -> dict[str, Any]:
        status, body = self.get("admin", "/config_dump")
        assert status == 200, (status, body)
        dump: dict[str, Any] = json.loads(body)
        return dump

    def worker_entries(self) -> list[dict[str, Any]]:
        """`/config_dump`'s `workers`: one entry (index, pid, state, counts) per worker."""
        workers: list[dict[str, Any]] = self.config_dump()["workers"]
        return workers

    def metrics_text(self) -> str:
        status, body = self.get("stats", "/metrics")
        assert status == 200, (status, body)
        return body.decode()

    def listeners(self) -> dict[str, tuple[str, int]]:
        """The data-plane listeners (name -> address) of the last worker's "proxy ready" log line."""
        lines = [line for line in self.log().splitlines() if ": proxy ready: " in line]
        assert lines, f"no proxy ready line in {self.name}'s log"
        text = lines[-1].rsplit(": proxy ready: ", 1)[1].rstrip('"')
        out = {}
        for item in filter(None, text.split(", ")):
            name, _, address = item.partition(" ")
            out[name] = _address(address)
        return out

    async def aconfig_dump(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.config_dump)


class ControlPlane(Process):
    """`ztunnel control-plane`: xDS and a CA from a YAML file it watches (`text`, written to
    `config`; a live change is a new file), or with `text` None from what `args` name (`--config
    FILE`, `--kube DIR`), listening on `address`. Ready once it logged its root certificate."""

    def __init__(
        self,
        directory: Path,
        listen: str,
        text: str | None,
        *args: str,
        netns: str | None = None,
        env: Mapping[str, str] = {},
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.config = directory / "mesh.yaml"
        source = []
        if text is not None:
            self.config.write_text(text)
            source = ["--config", str(self.config)]
        self.address = listen
        argv = ["control-plane", *source, "--listen", listen, "--ca-dir", str(directory / "ca"), *args]
        log_path = directory / "control-plane.log"
        super().__init__(argv, clean_env(env), log_path, netns=netns, name="control-plane")

    def is_ready(self) -> bool:
        return "root certificate:" in self.log()

    @property
    def url(self) -> str:
        return f"{'https' if '--tls' in self.args else 'http'}://{self.address}"

    @property
    def root(self) -> Path:
        """The root certificate it logged (of its last start)."""
        found = re.findall(r"root certificate: (\S+)", self.log())
        assert found, f"no root certificate in the control plane's log:\n{self.tail()}"
        return Path(found[-1])

    def wire(self, env: Mapping[str, str]) -> dict[str, str]:
        """A proxy's `env` fed by this control plane instead of a local config and the fake CA."""
        wired = {k: v for k, v in env.items() if k not in ("LOCAL_XDS", "LOCAL_XDS_PATH", "FAKE_CA")}
        wired.update(XDS_ADDRESS=self.url, CA_ADDRESS=self.url)
        return wired

    def push(self, text: str) -> None:
        """A new config, written whole (the control plane reads the file when it changes)."""
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.config)

    def streams_opened(self, node_id_part: str = "") -> int:
        """xDS streams it logged as opened, of a node whose id contains `node_id_part`."""
        return len(re.findall(rf"stream from \S*{re.escape(node_id_part)}\S* \(peer .*\) opened", self.log()))

    def certificates_issued(self, identity: str) -> int:
        return self.log().count(f"issued a certificate for {identity} ")


class NodeAgent(Process):
    """`ztunnel cni-agent`: ready once its CNI socket accepts connections."""

    def __init__(
        self,
        log_path: Path,
        zds_socket: Path,
        cni_socket: Path,
        args: Sequence[str],
        env: Mapping[str, str] = {},
        *,
        netns: str | None = None,
    ) -> None:
        self.zds_socket, self.cni_socket = zds_socket, cni_socket
        argv = ["cni-agent", "--zds-socket", str(zds_socket), "--cni-socket", str(cni_socket), *args]
        super().__init__(argv, clean_env(env), log_path, netns=netns, name="cni-agent")

    def is_ready(self) -> bool:
        if not self.zds_socket.exists():
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(self.cni_socket))
            except OSError:
                return False
        return True
