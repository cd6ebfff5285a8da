"""`CRL_PATH`: the certificate revocation lists the proxy enforces, loaded at start-up and reloaded
whenever the file changes.

At start-up an unreadable or invalid file is a one-line error (the proxy does not start). Later,
the file is polled (`os.stat`, so a Kubernetes ConfigMap's symlink swap counts as a change); a
changed file that reads and parses replaces the lists in force, and every open HBONE session is
re-checked against them (revoked ones are torn down: inbound with a GOAWAY, outbound by dropping
the pooled connection). A reload that fails keeps the last good lists and logs why.

The lists and the registry of live sessions are `hbone.tls.Revocation`; this module owns only the
file and the counters.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os

from cryptography import x509

from hbone.tls import Revocation, parse_crls
from ztunnel.metrics.families import Metrics

log = logging.getLogger("ztunnel.identity.crl")

POLL_INTERVAL = 1.0


class CrlError(Exception):
    """The CRL file cannot be used; the message is the one line to show."""


def _read(path: str) -> tuple[tuple[x509.CertificateRevocationList, ...], str]:
    """The file's CRLs, parsed, and the digest of its bytes; raise `CrlError`."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CrlError(f"CRL_PATH={path}: cannot read the CRL file: {e.strerror or e}") from None
    try:
        crls = parse_crls(data)
    except ValueError as e:
        raise CrlError(f"CRL_PATH={path}: invalid CRL file: {e}") from None
    return crls, hashlib.sha256(data).hexdigest()


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class CrlWatcher:
    """The CRL file behind a `Revocation`; `load` it at start-up, then `run` (or `check`) reloads it."""

    def __init__(self, path: str, revocation: Revocation, digest: str, stamp: tuple[int, int, int] | None):
        self.path = path
        self.revocation = revocation
        self._digest = digest
        self._stamp = stamp
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def load(cls, path: str, metrics: Metrics | None = None) -> CrlWatcher:
        """Read and parse the file now; raise `CrlError` (one line) when it cannot be used."""
        stamp = _stamp(path)
        crls, digest = _read(path)
        counters = metrics.crl() if metrics is not None else None
        revocation = Revocation(
            crls,
            on_rejection=counters.rejection if counters else None,
            on_untracked=counters.untracked_connection if counters else None,
        )
        log.info("loaded %d CRL(s) from %s", len(revocation.crls), path)
        return cls(path, revocation, digest, stamp)

    def check(self) -> bool:
        """Reload if the file changed since the last look; True when new lists were installed."""
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            crls, digest = _read(self.path)
        except CrlError as e:
            log.warning("CRL reload failed, keeping the last good list: %s", e)
            return False
        if digest == self._digest:
            return False  # touched or swapped for the same content
        self._digest = digest
        torn = self.revocation.replace(crls)
        log.info(
            "reloaded %d CRL(s) from %s: %d open connection(s) closed as revoked", len(crls), self.path, torn
        )
        return True

    def start(self, interval: float = POLL_INTERVAL) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(interval), name="CRL reload")

    async def _run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                self.check()
            except Exception:
                # Never let one bad reload stop the watching: the next change is tried again.
                log.exception("CRL reload failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
