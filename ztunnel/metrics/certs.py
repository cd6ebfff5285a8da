"""`istio_cert_expiry_seconds{identity}`: the NotAfter, in Unix seconds, of each workload certificate
the proxy holds. The certificates are the control process's (`ztunnel.identity.certificates`: the
workers get copies from it), so only it registers this family, read from there at each scrape: a
series comes with an identity's first certificate, changes with each rotation and leaves when the
identity is forgotten."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from ztunnel.metrics.registry import GaugeMetricFamily, Metric

NAME = "istio_cert_expiry_seconds"


class CertExpiry:
    """A collector over `source`: (SPIFFE URI, NotAfter in Unix seconds) of each identity held."""

    def __init__(self, source: Callable[[], Iterable[tuple[str, float]]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            NAME,
            "The Unix time, in seconds, at which the workload certificate of the identity expires",
            labels=("identity",),
        )
        for identity, expires in self._source():
            family.add_metric((identity,), expires)
        yield family
