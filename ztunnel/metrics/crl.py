"""Certificate revocation's families (`CRL_PATH`; not in the reference): handshakes refused and
sessions torn down because a CRL revoked the peer's chain, and sessions admitted that are not kept
for re-checks on a reload."""

from __future__ import annotations

from ztunnel.metrics.registry import CounterFamily, Families


class CrlCounters:
    """`istio_crl_policy_rejections` and `istio_crl_untracked_connections`."""

    def __init__(self) -> None:
        self.rejections = CounterFamily(
            "istio_crl_policy_rejections",
            "The total number of connections rejected or closed because a CRL revoked the peer certificate",
            (),
        )
        self.untracked = CounterFamily(
            "istio_crl_untracked_connections",
            "The total number of connections not re-checked when the CRL changes",
            (),
        )
        # Shown from the start (at 0) once revocation is on.
        self._rejections = self.rejections.cell(())
        self._untracked = self.untracked.cell(())

    def collector(self) -> Families:
        return Families((self.rejections, self.untracked))

    def rejection(self) -> None:
        self._rejections.inc()

    def untracked_connection(self) -> None:
        self._untracked.inc()
