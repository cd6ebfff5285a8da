"""`ztunnel cni-agent`: the node agent of in-pod mode.

It serves two sockets:

* the ZDS socket (`--zds-socket`, SOCK_SEQPACKET), where ztunnel connects. Each new connection gets the
  snapshot: `AddWorkload` with the pod's netns fd for every known pod (`KeepWorkload` when the netns
  cannot be opened), then `SnapshotSent`. Afterwards a new pod goes to the newest ztunnel only (the one
  taking over during an upgrade), a deleted pod to every ztunnel. `cni.ztunnels` holds one connection.
* the CNI socket (`--cni-socket`), where the `ztunnel-cni` plugin reports pod events (`cni.events`).
  ADD writes the redirection rules in the pod's namespace (`cni.redirect`), holds the namespace open,
  records the pod and answers only once a ztunnel acknowledged it; a failure undoes all of it. DEL tells
  every ztunnel, removes the rules and forgets the pod, and always succeeds. CHECK verifies.

The pods are kept in `--state-file` (`cni.pods`). At start the agent reloads it: a pod whose namespace
still opens is held again, its rules re-written, and it is in every ztunnel's snapshot; the others were
deleted while the agent was down and are forgotten.

Events for one pod are handled one at a time; nothing a plugin or a ztunnel sends can stop the agent,
it only costs that request or that connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from cni import (
    DEFAULT_CNI_SOCKET,
    DEFAULT_STATE_FILE,
    DEFAULT_ZDS_SOCKET,
    DEFAULT_ZTUNNEL_WAIT,
    pods,
    redirect,
)
from cni.events import (
    AGENT_FAILURE,
    INVALID_CONFIG,
    MAX_LINE,
    NOT_ENROLLED,
    TRY_AGAIN_LATER,
    ZTUNNEL_REFUSED,
    PodEvent,
    Reply,
    decode_event,
)
from cni.install import (
    DEFAULT_INTERPRETER,
    InstallConfig,
)
from cni.pods import Pod
from cni.ztunnels import ZtunnelConnection, ZtunnelGone
from xds import zds

log = logging.getLogger("cni.agent")

REQUEST_READ_TIMEOUT = 10.0  # for the plugin to send its one line
ACCEPTS_PER_SECOND = 5


class AgentError(Exception):
    """The agent cannot start: a bad option, an unusable socket path or state file."""


@dataclass(frozen=True)
class AgentConfig:
    zds_socket: Path
    cni_socket: Path
    state_file: Path
    ztunnel_wait: float
    install: InstallConfig | None = None
    dns_capture: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AgentConfig:
        def path(option: str, default: str) -> Path:
            value = getattr(args, option.lstrip("-").replace("-", "_"), None) or default
            if not isinstance(value, str) or not value.strip():
                raise AgentError(f"{option}: empty path")
            return Path(value)

        wait = getattr(args, "ztunnel_wait", DEFAULT_ZTUNNEL_WAIT)
        if not isinstance(wait, int | float) or not 0 <= wait <= 3600:
            raise AgentError(f"--ztunnel-wait: {wait!r} is not a number of seconds between 0 and 3600")
        config = cls(
            zds_socket=path("--zds-socket", DEFAULT_ZDS_SOCKET),
            cni_socket=path("--cni-socket", DEFAULT_CNI_SOCKET),
            state_file=path("--state-file", DEFAULT_STATE_FILE),
            ztunnel_wait=float(wait),
            install=_install_config(args, path("--cni-socket", DEFAULT_CNI_SOCKET)),
            dns_capture=not getattr(args, "no_dns_capture", False),
        )
        if config.zds_socket == config.cni_socket:
            raise AgentError(f"--zds-socket and --cni-socket are the same path: {config.zds_socket}")
        return config


def _install_config(args: argparse.Namespace, cni_socket: Path) -> InstallConfig | None:
    bin_dir, conf_dir = getattr(args, "cni_bin_dir", None), getattr(args, "cni_conf_dir", None)
    if bin_dir is None and conf_dir is None:
        if getattr(args, "uninstall", False):
            raise AgentError("--uninstall needs --cni-bin-dir and --cni-conf-dir")
        return None
    if not bin_dir or not conf_dir:
        raise AgentError("--cni-bin-dir and --cni-conf-dir go together")
    node_socket = getattr(args, "node_cni_socket", None) or str(cni_socket)
    excluded = getattr(args, "exclude_namespaces", None) or ""
    namespaces = tuple(n.strip() for n in excluded.split(",") if n.strip())
    interpreter = getattr(args, "node_python", None) or DEFAULT_INTERPRETER
    return InstallConfig(
        Path(bin_dir), Path(conf_dir), node_socket, interpreter=interpreter, exclude_namespaces=namespaces
    )


@dataclass
class _PodLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.pods: dict[str, Pod] = {}
        self.ztunnels: list[ZtunnelConnection] = []  # after their hello, oldest first
        self._connections = 0
        self._ztunnel_arrived: asyncio.Condition | None = None
        self._pod_locks: dict[str, _PodLock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepted: list[float] = []  # loop times of the accepts in the last second
        self._accept_paused: asyncio.TimerHandle | None = None

    # -- start and stop -----------------------------------------------------------------------------

    def reload(self) -> None:
        """Reconcile after a restart: keep the pods of the state file whose namespace still opens."""
        path = self.config.state_file
        make_parent(path, "--state-file")
        try:
            saved, skipped = pods.load(path)
        except pods.StateFileError as e:
            raise AgentError(f"--state-file {e}") from None
        for note in skipped:
            log.warning("state file %s: ignoring %s", path, note)
        for uid, pod in saved.items():
            try:
                pod.fd = _open_netns(pod.netns)
            except OSError as e:
                log.info(
                    "forgetting pod %s (uid %s): its network namespace %s is gone: %s",
                    pod.display,
                    uid,
                    pod.netns,
                    e.strerror,
                )
                continue
            try:
                redirect.install(pod.netns, self.config.dns_capture)
            except redirect.RedirectError as e:
                log.warning("pod %s: cannot restore its redirection: %s", pod.display, e)
            self.pods[uid] = pod
            log.info("pod %s (uid %s) restored from %s", pod.display, uid, path)
        self._persist()

    async def serve(
        self, zds_listener: socket.socket, cni_listener: socket.socket, stop: asyncio.Event
    ) -> None:
        loop = asyncio.get_running_loop()
        self._ztunnel_arrived = asyncio.Condition()
        zds_listener.setblocking(False)
        loop.add_reader(zds_listener.fileno(), self._accept_ztunnels, zds_listener)
        server = await asyncio.start_unix_server(self._serve_plugin, sock=cni_listener, limit=MAX_LINE)
        log.info(
            "cni agent ready: ZDS on %s, CNI events on %s, %d pod(s) known",
            self.config.zds_socket,
            self.config.cni_socket,
            len(self.pods),
        )
        try:
            await stop.wait()
        finally:
            if self._accept_paused is not None:
                self._accept_paused.cancel()
            loop.remove_reader(zds_listener.fileno())
            server.close()
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=2.0)
            for conn in list(self.ztunnels):
                conn.close("agent shutting down")

    def close(self) -> None:
        """Release the held namespaces. The pods stay enrolled: their rules and state file remain."""
        for pod in self.pods.values():
            _close_fd(pod)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- ZDS ----------------------------------------------------------------------------------------

    def _accept_ztunnels(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # At most ACCEPTS_PER_SECOND, as the reference: a ztunnel in a reconnect loop cannot
            # keep the agent busy with snapshots.
            now = loop.time()
            self._accepted = [t for t in self._accepted if now - t < 1.0]
            if len(self._accepted) >= ACCEPTS_PER_SECOND:
                loop.remove_reader(listener.fileno())
                self._accept_paused = loop.call_later(
                    1.0 - (now - self._accepted[0]), self._resume_accepting, listener
                )
                return
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("accepting a ztunnel connection failed: %s", e)
                return
            self._accepted.append(now)
            self._connections += 1
            self._spawn(self._serve_ztunnel(sock, self._connections))

    def _resume_accepting(self, listener: socket.socket) -> None:
        self._accept_paused = None
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept_ztunnels, listener)

    async def _serve_ztunnel(self, sock: socket.socket, number: int) -> None:
        conn = ZtunnelConnection(sock, number, self._ztunnel_closed)
        try:
            await conn.hello()
        except ZtunnelGone:
            return
        except asyncio.CancelledError:
            conn.close("agent shutting down")
            raise
        log.info("%s: ztunnel connected, sending the snapshot of %d pod(s)", conn, len(self.pods))
        self.ztunnels.append(conn)
        assert self._ztunnel_arrived is not None
        async with self._ztunnel_arrived:
            self._ztunnel_arrived.notify_all()
        try:
            await self._send_snapshot(conn)
        except ZtunnelGone:
            pass

    def _ztunnel_closed(self, conn: ZtunnelConnection) -> None:
        if conn in self.ztunnels:
            self.ztunnels.remove(conn)

    async def _send_snapshot(self, conn: ZtunnelConnection) -> None:
        async with conn.lock:
            # Dup'ed now, so a pod deleted while the snapshot is on its way cannot close them under us.
            messages: list[tuple[Pod, bytes, int | None]] = []
            for pod in self.pods.values():
                fd = _dup_netns(pod)
                if fd is None:
                    messages.append((pod, zds.keep(pod.uid), None))
                else:
                    messages.append((pod, zds.add(pod.uid, pod.name, pod.namespace, pod.service_account), fd))
            try:
                for pod, data, fd in messages:
                    try:
                        error = await conn.exchange(data, () if fd is None else (fd,))
                    except zds.ZdsError as e:
                        log.warning("%s: pod %s left out of the snapshot: %s", conn, pod.display, e)
                        continue
                    if error:
                        log.warning(
                            "%s: ztunnel refused pod %s in the snapshot: %s", conn, pod.display, error
                        )
                error = await conn.exchange(zds.snapshot_sent())
                if error:
                    log.warning("%s: ztunnel answered SnapshotSent with an error: %s", conn, error)
                log.info("%s: snapshot of %d pod(s) sent", conn, len(messages))
            finally:
                for _, _, fd in messages:
                    if fd is not None:
                        os.close(fd)

    def _newest_ztunnel(self) -> ZtunnelConnection | None:
        live = [c for c in self.ztunnels if not c.closed]
        return live[-1] if live else None

    async def _wait_for_ztunnel(self, timeout: float) -> None:
        arrived = self._ztunnel_arrived
        assert arrived is not None
        async with arrived:  # checked under the lock the arrival is announced with: no missed wake-up
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrived.wait_for(lambda: self._newest_ztunnel() is not None), timeout)

    async def _tell_ztunnel(self, pod: Pod) -> Reply:
        """Send the new pod to the newest ztunnel (waiting a while for one) and return its answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.ztunnel_wait
        assert pod.fd is not None
        while True:
            conn = self._newest_ztunnel()
            if conn is None:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return Reply(
                        False,
                        TRY_AGAIN_LATER,
                        f"no ztunnel connected to the agent within {self.config.ztunnel_wait:g}s"
                        f" (ZDS socket {self.config.zds_socket})",
                    )
                await self._wait_for_ztunnel(remaining)
                continue
            try:
                error = await conn.request(
                    zds.add(pod.uid, pod.name, pod.namespace, pod.service_account), (pod.fd,)
                )
            except ZtunnelGone:
                continue  # the next newest, if any, or wait for a new one
            except zds.ZdsError as e:
                return Reply(False, AGENT_FAILURE, f"cannot send pod {pod.display} to ztunnel: {e}")
            if error:
                return Reply(False, ZTUNNEL_REFUSED, f"ztunnel refused pod {pod.display}: {error}")
            log.info("%s: ztunnel acknowledged pod %s", conn, pod.display)
            return Reply(True)

    async def _tell_all_deleted(self, uid: str) -> None:
        """DelWorkload to every ztunnel; a failure only gets logged."""
        conns = [c for c in self.ztunnels if not c.closed]
        results = await asyncio.gather(*(c.request(zds.delete(uid)) for c in conns), return_exceptions=True)
        for conn, result in zip(conns, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("%s: DelWorkload %s not acknowledged: %s", conn, uid, result)
            elif result:
                log.warning("%s: ztunnel answered DelWorkload %s with an error: %s", conn, uid, result)

    # -- pod events from the plugin -----------------------------------------------------------------

    async def _serve_plugin(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:  # cancelled at shutdown, like the ztunnel conversations
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            try:
                line = await asyncio.wait_for(reader.readline(), REQUEST_READ_TIMEOUT)
                if not line:
                    return  # a probe, or a plugin that gave up
                event = decode_event(line)
            except (TimeoutError, ConnectionError) as e:
                log.warning("CNI request not read: %s", e or type(e).__name__)
                return
            except ValueError as e:  # an EventError, or a line longer than MAX_LINE
                log.warning("invalid CNI request: %s", e)
                reply = Reply(False, INVALID_CONFIG, f"invalid request to the agent: {e}")
            else:
                reply = await self.handle(event)
            writer.write(reply.encode())
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        finally:
            writer.close()

    async def handle(self, event: PodEvent) -> Reply:
        handlers: dict[str, Callable[[PodEvent], Awaitable[Reply]]] = {
            "ADD": self._add,
            "DEL": self._delete,
            "CHECK": self._check,
        }
        async with self._pod_lock(event.uid):
            try:
                return await handlers[event.command](event)
            except Exception as e:  # a bug must cost this request only
                log.exception("%s of pod uid %s failed", event.command, event.uid)
                return Reply(False, AGENT_FAILURE, f"agent error: {type(e).__name__}: {e}")

    @contextlib.asynccontextmanager
    async def _pod_lock(self, uid: str) -> AsyncIterator[None]:
        """One event at a time per pod; the lock lives while someone holds or waits for it."""
        entry = self._pod_locks.setdefault(uid, _PodLock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._pod_locks[uid]

    async def _add(self, event: PodEvent) -> Reply:
        pod = Pod.from_event(event)
        log.info(
            "ADD pod %s (uid %s, netns %s, ips %s)", pod.display, pod.uid, pod.netns, ",".join(pod.ips) or "-"
        )
        try:
            pod.fd = _open_netns(pod.netns)
        except OSError as e:
            return Reply(
                False, AGENT_FAILURE, f"cannot open the network namespace {pod.netns}: {e.strerror or e}"
            )
        try:
            await asyncio.to_thread(redirect.install, pod.netns, self.config.dns_capture)
        except redirect.RedirectError as e:
            _close_fd(pod)
            return Reply(False, AGENT_FAILURE, f"redirection not installed for pod {pod.display}: {e}")
        previous = self.pods.get(pod.uid)
        if previous is not None:
            _close_fd(previous)  # a re-ADD: the new fd replaces it
        self.pods[pod.uid] = pod
        self._persist()
        reply = await self._tell_ztunnel(pod)
        if reply.ok:
            log.info("pod %s enrolled", pod.display)
            return reply
        log.warning("ADD pod %s failed, undoing it: %s", pod.display, reply.error)
        await self._forget(pod)
        return reply

    async def _forget(self, pod: Pod) -> None:
        """Undo a failed ADD: no ztunnel keeps (or retries) the pod, no rules, no record."""
        self.pods.pop(pod.uid, None)
        self._persist()
        await self._tell_all_deleted(pod.uid)
        await self._remove_rules(pod.display, pod.netns)
        _close_fd(pod)

    async def _delete(self, event: PodEvent) -> Reply:
        pod = self.pods.pop(event.uid, None)
        if pod is None:
            log.info("DEL pod uid %s: not enrolled", event.uid)
        else:
            log.info("DEL pod %s (uid %s)", pod.display, pod.uid)
            self._persist()
        # Even for a pod we do not know: a ztunnel may know it from a previous agent.
        await self._tell_all_deleted(event.uid)
        netns = pod.netns if pod is not None else event.netns
        if netns and os.path.exists(netns):
            await self._remove_rules(pod.display if pod else event.uid, netns)
        if pod is not None:
            _close_fd(pod)
        return Reply(True)

    async def _check(self, event: PodEvent) -> Reply:
        pod = self.pods.get(event.uid)
        if pod is None:
            return Reply(False, NOT_ENROLLED, f"pod uid {event.uid} is not enrolled in the agent")
        try:
            missing = await asyncio.to_thread(redirect.check, pod.netns, self.config.dns_capture)
        except redirect.RedirectError as e:
            return Reply(False, NOT_ENROLLED, f"pod {pod.display}: cannot read its redirection rules: {e}")
        if missing:
            return Reply(False, NOT_ENROLLED, f"pod {pod.display}: redirection rules missing: {missing[0]}")
        return Reply(True)

    async def _remove_rules(self, who: str, netns: str) -> None:
        try:
            await asyncio.to_thread(redirect.remove, netns)
        except redirect.RedirectError as e:
            log.warning("pod %s: redirection not removed: %s", who, e)

    def _persist(self) -> None:
        try:
            pods.save(self.config.state_file, self.pods)
        except OSError as e:
            # The pods stay served; only a restart would forget them.
            log.error("cannot write the state file %s: %s", self.config.state_file, e)


# -- namespaces ---------------------------------------------------------------------------


def _open_netns(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def _close_fd(pod: Pod) -> None:
    if pod.fd is not None:
        with contextlib.suppress(OSError):
            os.close(pod.fd)
        pod.fd = None


def _dup_netns(pod: Pod) -> int | None:
    """A new fd for the pod's namespace: a dup of the held one, else the path opened again."""
    if pod.fd is not None:
        with contextlib.suppress(OSError):
            return os.dup(pod.fd)
    try:
        return _open_netns(pod.netns)
    except OSError:
        return None


def make_parent(path: Path, option: str) -> None:
    """Create the directory of a socket or state file given by `option`."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise AgentError(f"{option} {path}: {path.parent} is not a directory") from None
    except OSError as e:
        raise AgentError(f"{option} {path}: cannot create {path.parent}: {e.strerror}") from None
