"""Workload certificates per identity: the fake CA, the CA client interface and the secret manager that
fetches, shares, rotates and forgets certificates.

The secret manager is process-wide: every proxy whose workload has the same identity shares one
certificate. It is also the one owner of the TLS contexts: each certificate, when issued or
rotated, is turned into `TlsCredentials` (the certificate with its server and client contexts)
right away, and the listeners ask for those (`credentials(identity)`). Rotation runs at half-life off an injectable clock; `refresh_due(now)` is the step the
background scheduler takes, so tests can drive rotation without waiting.

What `/config_dump` shows of a certificate comes with it from the CA clients of this package (an
`IssuedCertificate`), computed where it was made or checked, so the dump needs no cryptography
here; a certificate that came bare (a worker's, a test's CA) is read here when dumped.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import IntEnum
from typing import Any, Protocol

from hbone.identity import Identity
from hbone.tls import TlsCredentials, TlsPolicy, WorkloadCertificate
from ztunnel.identity.certhelper import CertInfo, CertWork, InProcess, IssuedCertificate, describe_now, issued
from ztunnel.identity.certwork import CertWorkError, embedded_file, perform

log = logging.getLogger(__name__)

INITIAL_BACKOFF = 1.0
MAX_BACKOFF = 150.0
MAX_CONCURRENT_FETCHES = 8
# The scheduler re-reads the wall clock at least this often, so clock jumps are noticed.
_MAX_SLEEP = 60.0


class CaError(Exception):
    """The CA did not issue a certificate."""


class CertificateUnavailable(Exception):
    """No usable certificate for an identity (the IDENTITY_ERROR of the reference)."""


class CaClient(Protocol):
    async def fetch(self, identity: Identity) -> WorkloadCertificate:
        """The identity's certificate (an `IssuedCertificate` carries its dump); raise CaError."""
        ...


class Priority(IntEnum):
    """Order in which queued CA calls are made (lower first)."""

    REALTIME = 0  # a connection is waiting
    WARMUP = 1  # prefetch
    BACKGROUND = 2  # scheduled rotation


# --- fake CA -----------------------------------------------------------------------------------
# Its cryptography runs where `work` says (`ztunnel/identity/certhelper.py`): in this process by default, in a
# helper process for the proxy's parent. A data-plane worker, which only holds a `SecretManager`
# fed by its parent, never loads it.


class FakeCA:
    """CA signing with the embedded test root (`FAKE_CA=true`): every process using it trusts every
    other one. Trust domain `error` with namespace `forgotten` simulates a CA failure."""

    def __init__(self, *, clock: Callable[[], float] = time.time, work: CertWork | None = None) -> None:
        self._clock = clock
        self._work = work or InProcess()

    @property
    def root_pem(self) -> bytes:
        return _embedded_root_pem()

    def issue(self, identity: Identity, now: datetime | None = None) -> IssuedCertificate:
        """The certificate for `identity` valid from `now` (default: the wall clock), made in this process."""
        _refuse_simulated_failure(identity)
        # X.509 times have whole seconds: the certificate starts at the second `now` falls in.
        args = {"identity": str(identity), "not_before": int((now or datetime.now(UTC)).timestamp())}
        try:
            return issued(identity, perform("fake_issue", args))
        except CertWorkError as e:
            raise CaError(str(e)) from None

    async def fetch(self, identity: Identity) -> IssuedCertificate:
        _refuse_simulated_failure(identity)
        try:
            return await self._work.fake_issue(identity, datetime.fromtimestamp(self._clock(), UTC))
        except CertWorkError as e:
            raise CaError(str(e)) from None


def _refuse_simulated_failure(identity: Identity) -> None:
    if identity.trust_domain == "error" and identity.namespace == "forgotten":
        raise CaError(f"simulated CA failure for {identity}")


@functools.cache
def _embedded_root_pem() -> bytes:
    return embedded_file("root-cert.pem")


# --- secret manager ----------------------------------------------------------------------------


@dataclass(eq=False)
class _Ticket:
    priority: Priority
    seq: int
    future: asyncio.Future[None] | None = None


class _CallSlots:
    """At most `limit` CA calls at once; queued calls go by priority, then oldest first."""

    def __init__(self, limit: int) -> None:
        self._free = limit
        self._queue: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def ticket(self, priority: Priority) -> _Ticket:
        return _Ticket(priority, next(self._seq))

    async def acquire(self, ticket: _Ticket) -> None:
        if self._free > 0:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket.future = fut
        heapq.heappush(self._queue, (ticket.priority, ticket.seq, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just as we were cancelled
            raise

    def bump(self, ticket: _Ticket, priority: Priority) -> None:
        if priority >= ticket.priority:
            return
        ticket.priority = priority
        if ticket.future is not None and not ticket.future.done():
            # The stale heap entry is skipped once the future is done.
            heapq.heappush(self._queue, (priority, ticket.seq, ticket.future))

    def release(self) -> None:
        while self._queue:
            _, _, fut = heapq.heappop(self._queue)
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1


@dataclass(eq=False)
class _Entry:
    creds: TlsCredentials | None = None
    error: str | None = None  # set only while there is no valid certificate
    fetch: asyncio.Task[TlsCredentials] | None = None
    ticket: _Ticket | None = None
    refresh_at: float | None = None
    backoff: float = INITIAL_BACKOFF
    # What /config_dump shows of the certificate's chain and roots (None: not known yet).
    info: tuple[tuple[CertInfo, ...], tuple[CertInfo, ...]] | None = None
    # NotAfter (Unix seconds) of the last certificate fetched, kept through failed refreshes (and
    # past expiry) until the identity is forgotten: `istio_cert_expiry_seconds`.
    expires: float | None = None

    @property
    def cert(self) -> WorkloadCertificate | None:
        return self.creds.cert if self.creds is not None else None

    @property
    def state(self) -> str:
        if self.creds is not None:
            return "Available"
        if self.error is not None:
            return f"Unavailable: {self.error}"
        return "Initializing"


class SecretManager:
    """Certificates by identity: one shared in-flight fetch, rotation at half-life, retry with backoff.

    Every certificate comes with its TLS contexts, built under `tls` (versions, CRLs) on arrival.
    """

    def __init__(
        self,
        ca: CaClient,
        *,
        tls: TlsPolicy | None = None,
        clock: Callable[[], float] = time.time,
        max_concurrent_fetches: int = MAX_CONCURRENT_FETCHES,
        rng: random.Random | None = None,
    ) -> None:
        self._ca = ca
        self._tls = tls or TlsPolicy()
        self._clock = clock
        self._rng = rng or random.Random()
        self._slots = _CallSlots(max_concurrent_fetches)
        self._entries: dict[Identity, _Entry] = {}
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task[None] | None = None
        self._closed = False

    async def get(self, identity: Identity) -> WorkloadCertificate:
        """The identity's certificate, waiting for an in-flight fetch; raise CertificateUnavailable."""
        return (await self.credentials(identity)).cert

    async def credentials(self, identity: Identity) -> TlsCredentials:
        """The identity's certificate with its TLS contexts, waiting for an in-flight fetch; raise
        CertificateUnavailable. What the listeners present, on every handshake."""
        entry = self._entry(identity, Priority.REALTIME)
        creds = entry.creds
        if creds is not None and self._clock() < creds.cert.not_after.timestamp():
            return creds
        if entry.fetch is None:
            if entry.error is not None:
                raise CertificateUnavailable(entry.error)
            self._start_fetch(identity, entry, Priority.REALTIME)
        elif entry.ticket is not None:
            self._slots.bump(entry.ticket, Priority.REALTIME)
        task = entry.fetch
        assert task is not None
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                raise CertificateUnavailable(f"{identity} was forgotten") from None
            raise

    def prefetch(self, identity: Identity) -> None:
        """Start fetching a certificate that will soon be needed (at Warmup priority)."""
        self._entry(identity, Priority.WARMUP)

    def forget(self, identity: Identity) -> None:
        """Drop the identity's certificate and stop its refreshes."""
        entry = self._entries.pop(identity, None)
        if entry is not None and entry.fetch is not None:
            entry.fetch.cancel()

    def identities(self) -> list[Identity]:
        return sorted(self._entries, key=str)

    def expiries(self) -> list[tuple[str, float]]:
        """(SPIFFE URI, NotAfter in Unix seconds) of the last certificate fetched for each identity
        held, sorted: set by each successful fetch or rotation, gone when the identity is forgotten."""
        return [
            (str(identity), entry.expires)
            for identity in self.identities()
            if (entry := self._entries[identity]).expires is not None
        ]

    async def refresh_due(self, now: float | None = None) -> list[Identity]:
        """Start the refreshes and retries due at `now` (default: the clock) and wait for them."""
        started = self._start_due(self._clock() if now is None else now)
        await asyncio.gather(*(task for _, task in started), return_exceptions=True)
        return [identity for identity, _ in started]

    def dump(self) -> list[dict[str, Any]]:
        """The `certificates` section of `/config_dump`, sorted by identity."""
        out = []
        for identity in self.identities():
            entry = self._entries[identity]
            chain: list[CertInfo] = []
            roots: list[CertInfo] = []
            if entry.cert is not None:
                if entry.info is None:  # a CA that gave the bare certificate: read it here
                    entry.info = describe_now(entry.cert.chain_pem), describe_now(entry.cert.roots_pem)
                chain, roots = [dict(c) for c in entry.info[0]], [dict(c) for c in entry.info[1]]
            out.append(
                {"identity": str(identity), "state": entry.state, "certChain": chain, "rootCerts": roots}
            )
        return out

    async def close(self) -> None:
        self._closed = True
        tasks: list[asyncio.Task[Any]] = [e.fetch for e in self._entries.values() if e.fetch is not None]
        if self._scheduler is not None:
            tasks.append(self._scheduler)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._entries.clear()

    # --- internals ---

    def _entry(self, identity: Identity, priority: Priority) -> _Entry:
        if self._closed:
            raise CertificateUnavailable("secret manager is closed")
        entry = self._entries.get(identity)
        if entry is None:
            entry = self._entries[identity] = _Entry()
            self._start_fetch(identity, entry, priority)
            self._ensure_scheduler()
        return entry

    def _start_fetch(
        self, identity: Identity, entry: _Entry, priority: Priority
    ) -> asyncio.Task[TlsCredentials]:
        entry.refresh_at = None
        entry.ticket = self._slots.ticket(priority)
        task = asyncio.get_running_loop().create_task(
            self._run_fetch(identity, entry, entry.ticket), name=f"fetch certificate {identity}"
        )
        task.add_done_callback(_consume_result)
        entry.fetch = task
        return task

    async def _run_fetch(self, identity: Identity, entry: _Entry, ticket: _Ticket) -> TlsCredentials:
        try:
            await self._slots.acquire(ticket)
            try:
                cert = await self._ca.fetch(identity)
                info = None
                if isinstance(cert, IssuedCertificate):  # kept: the certificate alone, as workers get it
                    info, cert = (cert.chain_info, cert.root_info), cert.plain()
                # The contexts are built with the certificate, so a handshake never builds one.
                creds = TlsCredentials.build(cert, self._tls)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                return self._fetch_failed(identity, entry, e)
            finally:
                self._slots.release()
            entry.creds, entry.error, entry.backoff, entry.info = creds, None, INITIAL_BACKOFF, info
            not_before, not_after = cert.not_before.timestamp(), cert.not_after.timestamp()
            entry.refresh_at = not_before + (not_after - not_before) / 2
            entry.expires = not_after
            log.debug("fetched certificate for %s, refresh at %s", identity, entry.refresh_at)
            return creds
        finally:
            entry.fetch = None
            entry.ticket = None
            self._wake.set()

    def _fetch_failed(self, identity: Identity, entry: _Entry, err: Exception) -> TlsCredentials:
        now = self._clock()
        message = str(err) or type(err).__name__
        delay = entry.backoff * self._rng.uniform(0.8, 1.2)
        entry.backoff = min(entry.backoff * 2, MAX_BACKOFF)
        creds = entry.creds
        if creds is not None and now < creds.cert.not_after.timestamp():
            entry.refresh_at = min(now + delay, creds.cert.not_after.timestamp())
            log.warning(
                "failed to refresh certificate for %s, keeping the current one: %s", identity, message
            )
            return creds
        entry.creds, entry.error = None, message
        entry.refresh_at = now + delay
        log.warning("failed to fetch certificate for %s: %s", identity, message)
        raise CertificateUnavailable(message)

    def _start_due(self, now: float) -> list[tuple[Identity, asyncio.Task[TlsCredentials]]]:
        started = []
        for identity, entry in list(self._entries.items()):
            if entry.fetch is None and entry.refresh_at is not None and entry.refresh_at <= now:
                started.append((identity, self._start_fetch(identity, entry, Priority.BACKGROUND)))
        return started

    def _ensure_scheduler(self) -> None:
        if self._scheduler is None or self._scheduler.done():
            self._scheduler = asyncio.get_running_loop().create_task(
                self._schedule(), name="certificate rotation"
            )

    async def _schedule(self) -> None:
        while not self._closed:
            self._wake.clear()
            now = self._clock()
            self._start_due(now)
            due = [
                e.refresh_at for e in self._entries.values() if e.fetch is None and e.refresh_at is not None
            ]
            timeout = min(max(0.0, min(due) - now), _MAX_SLEEP) if due else None
            # asyncio.timeout, not wait_for: 3.11's wait_for swallows a cancel racing a set event.
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                pass


def _consume_result(task: asyncio.Task[TlsCredentials]) -> None:
    # Prefetch and rotation fetches have no waiter; their failures are already in the entry's state.
    if not task.cancelled():
        task.exception()
