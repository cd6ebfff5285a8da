"""The rendered metrics: label order and values of the traffic families, counts, and negotiation."""

from __future__ import annotations

import re

from prometheus_client.openmetrics.parser import text_string_to_metric_families

from ztunnel.metrics.exposition import OPENMETRICS_CONTENT_TYPE, TEXT_CONTENT_TYPE
from ztunnel.metrics.families import Metrics
from ztunnel.metrics.traffic import TrafficLabels

SPEC_LABEL_ORDER = [
    "reporter",
    "source_workload",
    "source_canonical_service",
    "source_canonical_revision",
    "source_workload_namespace",
    "source_principal",
    "source_app",
    "source_version",
    "source_cluster",
    "destination_service",
    "destination_service_namespace",
    "destination_service_name",
    "destination_workload",
    "destination_canonical_service",
    "destination_canonical_revision",
    "destination_workload_namespace",
    "destination_principal",
    "destination_app",
    "destination_version",
    "destination_cluster",
    "request_protocol",
    "response_flags",
    "connection_security_policy",
    "source_region",
    "source_zone",
    "destination_region",
    "destination_zone",
]

OUTBOUND = TrafficLabels(
    reporter="source",
    source_workload="client-5d9c",
    source_canonical_service="client",
    source_canonical_revision="v1",
    source_workload_namespace="demo",
    source_principal="spiffe://cluster.local/ns/demo/sa/client",
    source_app="client",
    source_version="v1",
    source_cluster="Kubernetes",
    destination_service="server.demo.svc.cluster.local",
    destination_service_namespace="demo",
    destination_service_name="server",
    destination_workload="server-7f4b",
    destination_canonical_service="server",
    destination_canonical_revision="latest",
    destination_workload_namespace="demo",
    destination_principal="spiffe://cluster.local/ns/demo/sa/server",
    destination_app="server",
    destination_version="latest",
    destination_cluster="Kubernetes",
    connection_security_policy="mutual_tls",
    source_region="eu",
    source_zone="eu-1",
)


def text(m: Metrics) -> str:
    body, _ = m.render(None)
    return body.decode()


def sample_lines(body: str, name: str) -> list[str]:
    return [line for line in body.splitlines() if line.startswith(name + "{")]


def labels_of(line: str) -> list[tuple[str, str]]:
    inner = line[line.index("{") + 1 : line.rindex("}")]
    return re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', inner)


def value(body: str, name: str, **match: str) -> float | None:
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in match.items()):
                return s.value
    return None


def test_labels_in_spec_order_with_values() -> None:
    m = Metrics(process_metrics=False)
    m.open_connection(OUTBOUND)
    [line] = sample_lines(text(m), "istio_tcp_connections_opened_total")
    labels = labels_of(line)
    assert [k for k, _ in labels] == SPEC_LABEL_ORDER
    values = dict(labels)
    assert values["reporter"] == "source"
    assert values["source_principal"] == "spiffe://cluster.local/ns/demo/sa/client"
    assert values["request_protocol"] == "tcp"
    assert values["response_flags"] == "-"
    assert values["connection_security_policy"] == "mutual_tls"
    assert (values["source_region"], values["source_zone"]) == ("eu", "eu-1")
    assert (values["destination_region"], values["destination_zone"]) == ("unknown", "unknown")
    assert line.endswith(" 1")


def test_missing_values_render_unknown() -> None:
    m = Metrics(process_metrics=False)
    m.open_connection(TrafficLabels(reporter="destination", source_workload=""))
    [line] = sample_lines(text(m), "istio_tcp_connections_opened_total")
    values = dict(labels_of(line))
    assert values["reporter"] == "destination"
    assert values["source_workload"] == "unknown"
    assert values["destination_principal"] == "unknown"
    assert values["request_protocol"] == "tcp"


def test_open_bytes_close_counts() -> None:
    m = Metrics(process_metrics=False)
    a = m.open_connection(OUTBOUND)
    b = m.open_connection(OUTBOUND)
    a.received(100)
    a.received(28)
    a.sent(2048)
    b.sent(1)
    body = text(m)
    assert value(body, "istio_tcp_connections_opened_total", reporter="source") == 2
    assert value(body, "istio_tcp_received_bytes_total", response_flags="-") == 128
    assert value(body, "istio_tcp_sent_bytes_total", response_flags="-") == 2049
    assert "istio_tcp_connections_closed_total" not in body
    a.close()
    a.close()  # counted once
    body = text(m)
    assert value(body, "istio_tcp_connections_closed_total", response_flags="-") == 1
    assert "istio_tcp_connections_failed_total" not in body


def test_failed_connection_counts_closed_and_failed_with_the_flag() -> None:
    m = Metrics(process_metrics=False)
    c = m.open_connection(OUTBOUND)
    c.close("DENY")
    body = text(m)
    assert value(body, "istio_tcp_connections_opened_total", response_flags="-") == 1
    assert value(body, "istio_tcp_connections_closed_total", response_flags="DENY") == 1
    assert value(body, "istio_tcp_connections_closed_total", response_flags="-") is None
    assert value(body, "istio_tcp_connections_failed_total", response_flags="DENY") == 1
    [failed] = sample_lines(body, "istio_tcp_connections_failed_total")
    assert [k for k, _ in labels_of(failed)] == SPEC_LABEL_ORDER
    assert re.search(r"# HELP istio_tcp_connections_failed .*\(unstable\)", body)


def test_families_without_samples_are_omitted_and_build_is_always_there() -> None:
    m = Metrics("1.24.0", process_metrics=False)
    body = text(m)
    assert "istio_tcp" not in body
    assert 'istio_build{component="ztunnel",tag="1.24.0"} 1' in body
    assert body.endswith("# EOF\n")
    assert "_created" not in body
    assert "istio_tcp_sockets_open" not in body


def test_sockets_open_gauge() -> None:
    m = Metrics(process_metrics=False)
    g = m.sockets_open("source")
    g.inc()
    g.inc()
    g.dec()
    m.sockets_open("destination").inc()
    body = text(m)
    assert value(body, "istio_tcp_sockets_open", reporter="source") == 1
    assert value(body, "istio_tcp_sockets_open", reporter="destination") == 1


def test_process_metrics() -> None:
    body = text(Metrics())
    assert "process_open_fds " in body
    assert "process_max_fds " in body


def test_content_negotiation() -> None:
    m = Metrics(process_metrics=False)
    assert m.render(None)[1] == TEXT_CONTENT_TYPE == "text/plain; charset=utf-8"
    assert m.render("text/plain;version=0.0.4")[1] == TEXT_CONTENT_TYPE
    assert m.render("*/*")[1] == TEXT_CONTENT_TYPE
    prometheus_scraper = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    assert m.render(prometheus_scraper)[1] == OPENMETRICS_CONTENT_TYPE
    assert m.render("text/plain, Application/OpenMetrics-Text")[1] == OPENMETRICS_CONTENT_TYPE


def test_registries_are_independent() -> None:
    a, b = Metrics(process_metrics=False), Metrics(process_metrics=False)
    a.open_connection(OUTBOUND)
    assert "istio_tcp" in text(a)
    assert "istio_tcp" not in text(b)


def test_label_values_are_escaped() -> None:
    m = Metrics(process_metrics=False)
    odd = 'we"ird\\name\nx'
    m.open_connection(TrafficLabels(source_workload=odd))
    assert value(text(m), "istio_tcp_connections_opened_total", source_workload=odd) == 1
