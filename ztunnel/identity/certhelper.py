"""Where the certificate operations of `ztunnel/identity/certwork.py` run: in this process (`InProcess`: tests,
library use) or in a short-lived helper process (`CertHelper`: the shipped proxy's parent).

cryptography's native library alone is some 8 MiB of a process's memory, and the parent needs it
only at rare moments: when a certificate is made (the fake CA) or asked for and checked (the gRPC
CA client). So the parent starts a fresh interpreter for them on demand (`python -m
ztunnel.identity.certwork`, never a fork: the parent runs gRPC's threads), sends it requests over its stdin,
as many at once as come, and reads the answers from its stdout. The helper exits by itself once it
has had no work for a short linger (`LINGER`); the next request starts another. A helper that dies
with requests unanswered fails those with `CertWorkError` (the secret manager then retries with its
backoff); requests it never read, because it had just left for want of work, go to the next one.
Its stderr is logged here.

The certificates come back as `IssuedCertificate`: a `WorkloadCertificate` with what `/config_dump`
shows of its chain and roots, computed in the same operation, so the dump needs no cryptography.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from hbone.identity import Identity
from hbone.tls import WorkloadCertificate
from ztunnel.identity.certwork import LINGER, CertWorkError, JsonDict, perform

log = logging.getLogger("ztunnel.identity.certhelper")

# An answer that takes longer means a stuck helper: it is killed, which fails its requests.
REQUEST_TIMEOUT = 30.0
# One answer is one line: a certificate with its chain, bundle and their dump (a few KiB, more
# for a large bundle of roots).
LINE_LIMIT = 16 << 20

CertInfo = dict[
    str, str
]  # one certificate as /config_dump shows it: pem, serialNumber, validFrom, expirationTime


@dataclass(frozen=True)
class IssuedCertificate(WorkloadCertificate):
    """A certificate as it arrived, with what `/config_dump` shows of each certificate of its chain and
    of its roots."""

    chain_info: tuple[CertInfo, ...] = ()
    root_info: tuple[CertInfo, ...] = ()

    def plain(self) -> WorkloadCertificate:
        """The certificate alone (what is kept and shipped to the workers)."""
        return WorkloadCertificate(*(getattr(self, f.name) for f in fields(WorkloadCertificate)))


@dataclass(frozen=True)
class KeyRequest:
    key_pem: bytes  # PKCS#8
    csr_pem: bytes


def issued(identity: Identity, result: JsonDict) -> IssuedCertificate:
    """The certificate a `fake_issue` or `check_chain` result describes."""
    return IssuedCertificate(
        identity=identity,
        chain_pem=tuple(pem.encode() for pem in result["chain"]),
        key_pem=result["key"].encode(),
        roots_pem=tuple(pem.encode() for pem in result["roots"]),
        not_before=datetime.fromisoformat(result["notBefore"]),
        not_after=datetime.fromisoformat(result["notAfter"]),
        chain_info=tuple(result["chainInfo"]),
        root_info=tuple(result["rootInfo"]),
    )


class CertWork:
    """The certificate operations, typed; `run` says where they run. Each raises CertWorkError."""

    async def run(self, op: str, **args: Any) -> Any:
        raise NotImplementedError

    async def fake_issue(self, identity: Identity, not_before: datetime) -> IssuedCertificate:
        result = await self.run("fake_issue", identity=str(identity), not_before=int(not_before.timestamp()))
        return issued(identity, result)

    async def new_key(self, identity: Identity) -> KeyRequest:
        result = await self.run("new_key", identity=str(identity))
        return KeyRequest(result["key"].encode(), result["csr"].encode())

    async def check_chain(
        self, target: str, identity: Identity, key_pem: bytes, chain: Sequence[str], *, impersonate: bool
    ) -> IssuedCertificate:
        result = await self.run(
            "check_chain",
            target=target,
            identity=str(identity),
            key=key_pem.decode("ascii"),
            chain=list(chain),
            impersonate=impersonate,
        )
        return issued(identity, result)

    async def describe(self, pems: Sequence[bytes]) -> tuple[CertInfo, ...]:
        return tuple(await self.run("describe", pems=[p.decode("ascii") for p in pems]))

    async def close(self) -> None:
        return None


class InProcess(CertWork):
    """The operations in this process (which then loads cryptography)."""

    async def run(self, op: str, **args: Any) -> Any:
        return perform(op, args)


def describe_now(pems: Sequence[bytes]) -> tuple[CertInfo, ...]:
    """`describe` in this process, at once (for a certificate that came without its dump)."""
    return tuple(perform("describe", {"pems": [p.decode("ascii") for p in pems]}))


class _Process:
    """A child started with `posix_spawn`, its stdin, stdout and stderr pipes on the running loop.

    Not `asyncio.create_subprocess_exec`: under uvloop that forks, and a fork of a process running
    gRPC's threads goes through gRPC's fork handlers; `posix_spawn` (a vfork) runs none."""

    def __init__(self, pid: int, stdin: asyncio.WriteTransport, stdout: asyncio.StreamReader,
                 stderr: asyncio.StreamReader) -> None:  # fmt: skip
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    @classmethod
    async def spawn(cls, argv: Sequence[str]) -> _Process:
        """Start `argv` (raises OSError); its stderr and stdout are read with lines up to LINE_LIMIT."""
        loop = asyncio.get_running_loop()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid = os.posix_spawn(
                argv[0],
                list(argv),
                os.environ,
                file_actions=[(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate((in_r, out_w, err_w))],
            )
        except OSError:
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        stdin, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(in_w, "wb", 0))
        readers = []
        for fd in (out_r, err_r):
            reader = asyncio.StreamReader(limit=LINE_LIMIT)
            protocol = functools.partial(asyncio.StreamReaderProtocol, reader)
            await loop.connect_read_pipe(protocol, os.fdopen(fd, "rb", 0))
            readers.append(reader)
        return cls(pid, stdin, readers[0], readers[1])

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    async def wait(self) -> int:
        """Its exit code (negative: the signal), once it is reaped: polled, as it exits right after
        its stdout closed."""
        while self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its code is lost
                self.returncode = 255
                break
            if done == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            else:
                await asyncio.sleep(0.01)
        return self.returncode


@dataclass(eq=False)
class _Helper:
    """One helper process and the requests written to it, by id: each one's line and waiter."""

    process: _Process
    pending: dict[int, tuple[bytes, asyncio.Future[Any]]] = field(default_factory=dict)
    left: bool = False  # it said `bye`: what is pending it never read
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class CertHelper(CertWork):
    """The operations in a helper process started on demand, which leaves after `linger` idle seconds."""

    def __init__(self, *, linger: float = LINGER, argv: Sequence[str] | None = None) -> None:
        self._argv = list(argv or (sys.executable, "-m", "ztunnel.identity.certwork"))
        self._argv += ["--linger", str(linger)]
        self._current: _Helper | None = None  # where new requests go
        self._running: set[_Helper] = set()  # every helper not yet reaped
        self._starting = asyncio.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self.started = 0  # helper processes started so far

    @property
    def pid(self) -> int | None:
        """The running helper's pid (None when there is none)."""
        return self._current.process.pid if self._current is not None else None

    async def run(self, op: str, **args: Any) -> Any:
        if self._closed:
            raise CertWorkError("the certificate helper is closed")
        request_id = next(self._ids)
        line = json.dumps({"id": request_id, "op": op, "args": args}).encode() + b"\n"
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self._send(request_id, line, fut)
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                return await fut  # a late answer to a request cancelled or timed out is dropped
        except TimeoutError:
            self._kill_holder(request_id)
            raise CertWorkError(
                f"the certificate helper did not answer {op} in {REQUEST_TIMEOUT:.0f} s"
            ) from None

    async def close(self) -> None:
        """Stop the running helper (its pending requests fail); later requests fail."""
        self._closed = True
        helper, self._current = self._current, None
        if helper is None:
            return
        helper.process.stdin.close()
        try:
            async with asyncio.timeout(2.0):
                await asyncio.gather(*helper.tasks)
        except TimeoutError:
            helper.process.kill()
            await asyncio.gather(*helper.tasks, return_exceptions=True)

    # --- internals ---

    async def _send(self, request_id: int, line: bytes, fut: asyncio.Future[Any]) -> None:
        try:
            helper = await self._helper()
        except OSError as e:
            fut.set_exception(CertWorkError(f"cannot start the certificate helper: {e.strerror or e}"))
            return
        helper.pending[request_id] = (line, fut)
        # A helper gone meanwhile (its pipe closed, a write refused) is its reader's to tell: it
        # fails or resends what is pending.
        stdin = helper.process.stdin
        if not stdin.is_closing():
            with contextlib.suppress(RuntimeError, OSError):
                stdin.write(line)

    async def _helper(self) -> _Helper:
        async with self._starting:
            if self._current is None:
                if self._closed:
                    raise OSError("the certificate helper is closed")
                process = await _Process.spawn(self._argv)
                self.started += 1
                helper = self._current = _Helper(process)
                self._running.add(helper)
                loop = asyncio.get_running_loop()
                helper.tasks = [
                    loop.create_task(self._read(helper), name="certificate helper answers"),
                    loop.create_task(self._log_stderr(helper), name="certificate helper stderr"),
                ]
                log.debug("started certificate helper", extra={"fields": {"pid": process.pid}})
            return self._current

    async def _read(self, helper: _Helper) -> None:
        stdout = helper.process.stdout
        try:
            while line := await stdout.readline():
                self._on_line(helper, line)
        except (ValueError, KeyError, TypeError) as e:  # not our helper's output: it cannot be trusted
            log.error("certificate helper (pid %d) wrote something unreadable: %s", helper.process.pid, e)
            helper.process.kill()
        finally:
            await self._ended(helper)

    def _on_line(self, helper: _Helper, line: bytes) -> None:
        message = json.loads(line)
        if message.get("bye"):
            helper.left = True
            if self._current is helper:
                self._current = None
            return
        _, fut = helper.pending.pop(message["id"])
        if fut.done():
            return
        if "error" in message:
            fut.set_exception(CertWorkError(message["error"]))
        else:
            fut.set_result(message["result"])

    async def _ended(self, helper: _Helper) -> None:
        code = await helper.process.wait()
        self._running.discard(helper)
        if self._current is helper:
            self._current = None
        pending, helper.pending = helper.pending, {}
        if helper.left and not self._closed:
            if pending:
                log.debug(
                    "certificate helper left before reading %d requests: sent to the next", len(pending)
                )
            for request_id, (line, fut) in pending.items():
                if not fut.done():
                    await self._send(request_id, line, fut)
            return
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if pending:
            log.warning(
                "certificate helper (pid %d) exited (%s) with requests unanswered", helper.process.pid, why
            )
        for _, fut in pending.values():
            if not fut.done():
                fut.set_exception(
                    CertWorkError(f"the certificate helper process exited ({why}) before answering")
                )

    async def _log_stderr(self, helper: _Helper) -> None:
        stderr = helper.process.stderr
        with contextlib.suppress(ValueError):  # a line past LINE_LIMIT ends the relay, not the helper
            while line := await stderr.readline():
                log.warning(
                    "certificate helper (pid %d): %s",
                    helper.process.pid,
                    line.decode(errors="replace").rstrip(),
                )

    def _kill_holder(self, request_id: int) -> None:
        for helper in self._running:
            if request_id in helper.pending:
                helper.process.kill()
