"""A connection's traffic labels are remembered per pair of peers: every input of the labels, and
every field of `Peer` as the dataclass lists it, is in the cache key, so a connection is never
counted under the labels remembered for another (a field added to `Peer` is covered by this test
as soon as it exists)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from mesh.model import Service, Workload
from ztunnel.metrics.families import Metrics
from ztunnel.proxy.telemetry import ConnectionRecord, Peer, traffic_labels

SRC = Peer(name="client", namespace="demo", cluster="c1", canonical_service="client", canonical_revision="v1")
DST = Peer(name="server", namespace="demo", cluster="c1", canonical_service="server", canonical_revision="v1")


def other_value(peer: Peer, name: str) -> object:
    """A value of the field `name` unlike the peer's."""
    if name == "workload":
        return Workload(uid=f"uid-{name}", name="pod-0", namespace="elsewhere", workload_name="deploy")
    current = getattr(peer, name)
    return f"{current or name}-other" if name != "identity" else "spiffe://cluster.local/ns/x/sa/other"


def opened_series(metrics: Metrics) -> list[dict[str, str]]:
    body = metrics.render(None)[0].decode()
    for family in text_string_to_metric_families(body):
        if family.name == "istio_tcp_connections_opened":
            return [dict(s.labels) for s in family.samples]
    return []


def expected(src: Peer, dst: Peer, service: Service | None, reporter: str = "source") -> dict[str, str]:
    labels = traffic_labels(reporter, src, dst, service, "unknown")
    return {f.name: getattr(labels, f.name) for f in fields(labels)} | {"response_flags": "-"}


def connect(metrics: Metrics, src: Peer, dst: Peer, service: Service | None = None) -> None:
    record = ConnectionRecord(
        metrics, direction="outbound", src_addr="a", dst_addr="b", src=src, dst=dst, service=service
    )
    record.finish(received=0, sent=0)


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("name", [f.name for f in fields(Peer)])
def test_a_peer_that_differs_in_any_field_gets_its_own_labels(side: str, name: str) -> None:
    metrics = Metrics(process_metrics=False)
    connect(metrics, SRC, DST)
    peer = SRC if side == "src" else DST
    changed = replace(peer, **{name: other_value(peer, name)})
    src, dst = (changed, DST) if side == "src" else (SRC, changed)
    connect(metrics, src, dst)
    assert expected(src, dst, None) in opened_series(metrics)


def test_a_replaced_workload_or_service_gets_its_own_labels() -> None:
    """The store replaces a workload or service on change, never changes one: a new object with
    new values is a new key, even where an equal object was seen before."""
    metrics = Metrics(process_metrics=False)
    pod = Workload(uid="uid-1", name="pod-1", namespace="demo", canonical_revision="v1")
    svc = Service(name="echo", namespace="demo", hostname="echo.demo.svc.cluster.local")
    connect(metrics, SRC, Peer(workload=pod), svc)
    moved = replace(pod, canonical_revision="v2")
    renamed = replace(svc, hostname="echo2.demo.svc.cluster.local")
    connect(metrics, SRC, Peer(workload=moved), renamed)
    assert expected(SRC, Peer(workload=moved), renamed) in opened_series(metrics)
    assert len(opened_series(metrics)) == 2
