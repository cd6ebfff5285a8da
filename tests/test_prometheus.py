"""A real Prometheus (Debian's `prometheus`) scrapes live proxies the way Istio's sample Prometheus
scrapes pods, and every query of our dashboard (deploy/grafana-dashboard.json) answers, through
Prometheus's HTTP API, with the values the test's traffic implies.

What is emulated, and how: there is no Kubernetes here, so no `kubernetes_sd_configs`. Each proxy
is a scrape target whose labels are the ones Kubernetes service discovery would give its pod
(`__meta_kubernetes_pod_ip`, `_name`, `_node_name`, `_phase`, `_label_*`, and
`__meta_kubernetes_pod_annotation_*` made from the annotations of the pod template in
deploy/ztunnel.yaml), and the job applies the `relabel_configs` of Istio's sample Prometheus
(`prometheus.io/scrape` keeps, `prometheus.io/port` and `prometheus.io/path` pick the address and
the path, pod labels become labels, `namespace`, `pod` and `node` are added). A third target, a pod
without the annotations, must not be scraped. Everything after discovery is Prometheus's own:
relabelling, scraping (every second), storage, PromQL.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dns.message
import dns.query
import pytest
import yaml

from tests.apps import (
    echo_server,
    exchange,
    free_port,
    loopback_net,
    socks5,
    socks5_reply,
)
from tests.harness import Fleet, Proxy, proxy_env
from tests.netns import cannot_run
from tests.procs import open_fds, proportional_memory
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
NET = loopback_net()
CLIENT, SERVER, CP_HOST = f"{NET}.2", f"{NET}.3", f"{NET}.10"
APP_PORT, DENIED_PORT = 8080, 9999
TD = "cluster.local"

MESH = f"""
workloads:
  - uid: k//v1/Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client
    trustDomain: {TD}
    workloadIps: ["{CLIENT}"]
    protocol: HBONE
  - uid: k//v1/Pod/demo/server
    name: server
    namespace: demo
    serviceAccount: server
    trustDomain: {TD}
    workloadIps: ["{SERVER}"]
    protocol: HBONE
    hostname: ""
    services: {{"demo/server.demo.svc.cluster.local": {{80: {APP_PORT}}}}}
services:
  - name: server
    namespace: demo
    hostname: server.demo.svc.cluster.local
    vips: ["/10.96.7.7"]
    ports: {{80: {APP_PORT}}}
policies:
  - name: deny-{DENIED_PORT}
    namespace: demo
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - destinationPorts: [{DENIED_PORT}]
"""

# The traffic, and so the values the dashboard must show.
COMPLETED = 12  # client -> server echo, each PAYLOAD bytes each way
PAYLOAD = 1000
DENIED = 3  # client -> server:9999, denied by policy at the server
HELD = 4  # open while the queries are evaluated, HELD_BYTES each way
HELD_BYTES = 10
DNS_QUERIES = 5

# Istio's sample Prometheus, job `kubernetes-pods` (samples/addons/prometheus.yaml): its
# relabel_configs as they are.
ISTIO_POD_RELABELLING: list[dict[str, Any]] = [
    {"action": "keep", "regex": "true", "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]},
    {"action": "drop", "regex": "true", "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape_slow"]},
    {"action": "replace", "regex": "(https?)", "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scheme"], "target_label": "__scheme__"},
    {"action": "replace", "regex": "(.+)", "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"], "target_label": "__metrics_path__"},
    {"action": "replace", "regex": r"(\d+);(([A-Fa-f0-9]{1,4}::?){1,7}[A-Fa-f0-9]{1,4})", "replacement": "[$2]:$1",
     "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_port", "__meta_kubernetes_pod_ip"], "target_label": "__address__"},
    {"action": "replace", "regex": r"(\d+);((([0-9]+?)(\.|$)){4})", "replacement": "$2:$1",
     "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_port", "__meta_kubernetes_pod_ip"], "target_label": "__address__"},
    {"action": "labelmap", "regex": "__meta_kubernetes_pod_annotation_prometheus_io_param_(.+)", "replacement": "__param_$1"},
    {"action": "labelmap", "regex": "__meta_kubernetes_pod_label_(.+)"},
    {"action": "replace", "source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
    {"action": "replace", "source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    {"action": "drop", "regex": "Pending|Succeeded|Failed|Completed", "source_labels": ["__meta_kubernetes_pod_phase"]},
    {"action": "replace", "source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node"},
]  # fmt: skip

# The dashboard's variables, as Grafana expands them: all pods; the rate window of a panel whose step
# is 30 s (a few hours wide), so that the traffic of the last seconds is in it.
VARIABLES = {"$__rate_interval": "30s", "$pod": ".*"}


def _sanitize(name: str) -> str:
    """A Kubernetes label or annotation name as Kubernetes SD writes it into a meta label."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def ztunnel_pod_template() -> dict[str, Any]:
    for doc in yaml.safe_load_all((ROOT / "deploy" / "ztunnel.yaml").read_text()):
        if doc and doc["kind"] == "DaemonSet":
            template: dict[str, Any] = doc["spec"]["template"]
            return template
    raise AssertionError("no DaemonSet in deploy/ztunnel.yaml")


def pod_target(ip: str, name: str, node: str, metadata: dict[str, Any], first_port: int) -> dict[str, Any]:
    """The target Kubernetes SD (role: pod) makes for a running pod's first container port."""
    labels = {
        "__meta_kubernetes_namespace": "istio-system",
        "__meta_kubernetes_pod_name": name,
        "__meta_kubernetes_pod_ip": ip,
        "__meta_kubernetes_pod_node_name": node,
        "__meta_kubernetes_pod_phase": "Running",
    }
    for key, value in metadata.get("labels", {}).items():
        labels[f"__meta_kubernetes_pod_label_{_sanitize(key)}"] = str(value)
    for key, value in metadata.get("annotations", {}).items():
        labels[f"__meta_kubernetes_pod_annotation_{_sanitize(key)}"] = str(value)
        labels[f"__meta_kubernetes_pod_annotationpresent_{_sanitize(key)}"] = "true"
    return {"targets": [f"{ip}:{first_port}"], "labels": labels}


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[frozenset[tuple[str, str]], float]:
        """An instant query: each series' labels and value."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return {frozenset(s["metric"].items()): float(s["value"][1]) for s in data["result"]}


def start_prometheus(tmp: Path, targets: list[dict[str, Any]]) -> Prometheus:
    binary = shutil.which("prometheus")
    if binary is None:
        cannot_run("not installed: prometheus (Debian package prometheus)")
    assert binary is not None
    (tmp / "targets.json").write_text(json.dumps(targets))
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "kubernetes-pods",
                "honor_labels": True,
                "file_sd_configs": [{"files": [str(tmp / "targets.json")], "refresh_interval": "1s"}],
                "relabel_configs": ISTIO_POD_RELABELLING,
            }
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    listen = f"127.0.0.1:{free_port('127.0.0.1')}"
    log = tmp / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address={listen}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    prom = Prometheus(f"http://{listen}", process, log)

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return process.poll() is not None

    eventually(ready, lambda: f"prometheus ready\n{prom.output()}", timeout=30)
    assert process.poll() is None, prom.output()
    return prom


@dataclass
class Scene:
    prometheus: Prometheus
    client: Proxy
    server: Proxy
    held: list[socket.socket]


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory, module_fleet: Fleet) -> Iterator[Scene]:
    tmp = tmp_path_factory.mktemp("prometheus")
    with ExitStack() as stack:
        cp = module_fleet.control_plane(tmp, CP_HOST, MESH)
        stack.enter_context(echo_server(SERVER, APP_PORT))
        server, client = module_fleet.start_all(
            cp.wire(proxy_env(SERVER, "demo/server/server")), cp.wire(proxy_env(CLIENT, "demo/client/client"))
        )
        template = ztunnel_pod_template()
        metadata = template["metadata"]
        port = template["spec"]["containers"][0]["ports"][0]["containerPort"]
        unannotated = {"labels": metadata.get("labels", {})}  # a pod without prometheus.io/*
        targets = [
            pod_target(CLIENT, "ztunnel-client", "node-a", metadata, port),
            pod_target(SERVER, "ztunnel-server", "node-b", metadata, port),
            pod_target(CP_HOST, "not-scraped", "node-a", unannotated, port),
        ]
        prom = start_prometheus(tmp, targets)
        stack.callback(lambda: (prom.process.terminate(), prom.process.wait(timeout=10)))
        eventually(
            lambda: sum(prom.query("up").values()) == 2,
            lambda: f"both proxies up: {prom.query('up')}",
            timeout=30,
        )
        # A first round makes the series (a family has none before its first connection), and
        # Prometheus sees it; the rest of the traffic then grows them, as the rates must show.
        completed(1)
        denied(1)
        opened = "sum(istio_tcp_connections_opened_total)"
        eventually(lambda: prom.query(opened) == {frozenset(): 4.0}, "the first round scraped", timeout=30)
        completed(COMPLETED - 1)
        denied(DENIED - 1)
        held = hold(HELD)
        dns_queries(DNS_QUERIES)
        for s in held:
            stack.callback(s.close)
        yield Scene(prom, client, server, held)


def completed(n: int) -> None:
    for i in range(n):
        payload = bytes([65 + i % 26]) * PAYLOAD
        with socks5(CLIENT, SERVER, APP_PORT) as s:
            assert exchange(s, payload) == payload


def denied(n: int) -> None:
    for _ in range(n):
        s, code = socks5_reply(CLIENT, SERVER, DENIED_PORT)
        with s:
            assert code == 2  # not allowed: the server's policy denied it


def hold(n: int) -> list[socket.socket]:
    held = []
    for _ in range(n):
        s = socks5(CLIENT, SERVER, APP_PORT)
        s.sendall(b"h" * HELD_BYTES)
        got = b""
        while len(got) < HELD_BYTES:
            got += s.recv(HELD_BYTES)
        held.append(s)
    return held


def dns_queries(n: int) -> None:
    for _ in range(n):
        q = dns.message.make_query("server.demo.svc.cluster.local", "A")
        answer = dns.query.udp(q, CLIENT, port=15053, timeout=5)
        assert "10.96.7.7" in answer.to_text(), answer.to_text()


def _open_sockets(series: dict[frozenset[tuple[str, str]], float]) -> None:
    """Sockets accepted and open, summed over the workers: the client proxy's are the held SOCKS5
    connections; the server's are the HBONE connections carrying them (pooled: one per client worker
    that holds some, so one or two)."""
    got = by(series, "reporter")
    assert got.get(("source",)) == HELD, got
    assert 1 <= got.get(("destination",), 0) <= 2, got


def dashboard_queries() -> dict[str, str]:
    """Every query of the dashboard, `<panel title>/<refId>` -> PromQL with the variables expanded."""
    queries = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"an unexpanded variable in {panel['title']}: {expr}"
            queries[f"{panel['title']}/{target['refId']}"] = expr
    return queries


def by(series: dict[frozenset[tuple[str, str]], float], *names: str) -> dict[tuple[str, ...], float]:
    out = {}
    for labels, value in series.items():
        d = dict(labels)
        out[tuple(d.get(n, "") for n in names)] = value
    return out


OPENED = COMPLETED + DENIED + HELD
BYTES = COMPLETED * PAYLOAD + HELD * HELD_BYTES
PODS = {"ztunnel-client", "ztunnel-server"}
ADDRESS_URL = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION_URL = "type.googleapis.com/istio.security.Authorization"

# Queries whose series come only from parts not built yet: asserted empty, so this test fails (and
# the entry is removed) the day they appear.
EXPECTED_EMPTY: dict[str, str] = {}


def test_only_annotated_pods_are_scraped_with_their_pod_labels(scene: Scene) -> None:
    def up() -> dict[tuple[str, ...], float]:
        return by(scene.prometheus.query("up"), "pod", "namespace", "node", "app", "instance")

    eventually(
        lambda: len(up()) == 2 and all(v == 1 for v in up().values()), lambda: f"both proxies up: {up()}"
    )
    assert up() == {
        ("ztunnel-client", "istio-system", "node-a", "ztunnel", f"{CLIENT}:15020"): 1,
        ("ztunnel-server", "istio-system", "node-b", "ztunnel", f"{SERVER}:15020"): 1,
    }
    pods = scene.prometheus.api("label/pod/values", **{"match[]": 'istio_build{component="ztunnel"}'})
    assert set(pods) == PODS  # what the dashboard's pod variable offers


def test_every_dashboard_query_shows_what_the_traffic_did(scene: Scene) -> None:
    queries = dashboard_queries()
    checks = expectations(scene)
    assert set(queries) == set(checks) | set(EXPECTED_EMPTY), "every query checked, every check a query"
    last: dict[str, Any] = {}

    def all_hold() -> bool:
        ok = True
        for key, expr in queries.items():
            series = scene.prometheus.query(expr)
            last[key] = series
            if key in EXPECTED_EMPTY:
                ok = ok and series == {}
                continue
            try:
                checks[key](series)
            except AssertionError as e:
                last[key] = f"{series}: {e}"
                ok = False
        return ok

    eventually(all_hold, lambda: "\n".join(f"{k}: {v}" for k, v in last.items()), timeout=40, interval=0.5)
    # The held connections are still carried: the traffic is still flowing through them.
    for s in scene.held:
        s.sendall(b"x")
        assert s.recv(1) == b"x"


def _eq(want: dict[tuple[str, ...], float], *names: str) -> Any:
    def check(series: dict[frozenset[tuple[str, str]], float]) -> None:
        got = by(series, *names)
        assert got == want, f"want {want}"

    return check


def _per_pod(low: float, high: float = float("inf")) -> Any:
    def check(series: dict[frozenset[tuple[str, str]], float]) -> None:
        got = by(series, "pod")
        assert set(got) == {(p,) for p in PODS}, got
        assert all(low <= v <= high for v in got.values()), f"want {low}..{high}"

    return check


def _positive_by_reporter(series: dict[frozenset[tuple[str, str]], float]) -> None:
    got = by(series, "reporter")
    assert set(got) == {("source",), ("destination",)} and all(v > 0 for v in got.values()), (
        "want > 0 each side"
    )


def _xds(series: dict[frozenset[tuple[str, str]], float]) -> None:
    got = by(series, "pod", "url")
    for pod in PODS:
        for url in (ADDRESS_URL, AUTHORIZATION_URL):
            assert got.get((pod, url), 0) >= 1, f"want a message of {url} for {pod}"


def _per_pod_near(
    scene: Scene,
    reading: Callable[[list[int]], float],
    *,
    rel: float = 0.0,
    abs_: float = 0.0,
    low: float = 0,
) -> Any:
    """Each pod's value is what the test reads of its proxy's processes itself (within a margin)."""
    proxies = {"ztunnel-client": scene.client, "ztunnel-server": scene.server}

    def check(series: dict[frozenset[tuple[str, str]], float]) -> None:
        got = by(series, "pod")
        assert set(got) == {(p,) for p in PODS}, got
        for (pod,), v in got.items():
            want = reading(proxies[pod].pids())
            assert v >= low and v == pytest.approx(want, rel=rel, abs=abs_), f"{pod}: want {want}"

    return check


def _per_worker(low: float, high: float) -> Any:
    def check(series: dict[frozenset[tuple[str, str]], float]) -> None:
        got = by(series, "pod", "worker")
        assert set(got) == {(p, w) for p in PODS for w in ("0", "1")}, got
        assert all(low <= v <= high for v in got.values()), f"want {low}..{high}"

    return check


def expectations(scene: Scene) -> dict[str, Any]:
    both = {("source",): OPENED, ("destination",): OPENED}
    return {
        "Connections opened/A": _eq(both, "reporter"),
        "Connections open/A": _eq({("source",): HELD, ("destination",): HELD}, "reporter"),
        "Open sockets/A": _open_sockets,
        # Rates over the last few seconds: traffic then, so more than nothing each side.
        "Connections opened per second/A": _positive_by_reporter,
        "Connections closed by response flag/A": _eq(
            {
                ("source", "-"): COMPLETED,
                ("destination", "-"): COMPLETED,
                ("destination", "DENY"): DENIED,
                ("source", "CONNECT"): DENIED,
            },
            "reporter",
            "response_flags",
        ),
        "Failed connections/A": _eq({("source",): DENIED, ("destination",): DENIED}, "reporter"),
        "Connections by destination workload/A": _eq(
            {("demo", "server"): OPENED}, "destination_workload_namespace", "destination_workload"
        ),
        "Bytes/A": _eq({("source",): BYTES, ("destination",): BYTES}, "reporter"),
        "Bytes/B": _eq({("source",): BYTES, ("destination",): BYTES}, "reporter"),
        "Throughput/A": _positive_by_reporter,
        "Throughput/B": _positive_by_reporter,
        "DNS requests/A": _eq({("ztunnel-client", "a"): DNS_QUERIES}, "pod", "request_query_type"),
        "xDS messages/A": _xds,
        # The whole proxy of each pod (supervisor, workers), as the kernel lists it:
        # the client's held sockets and the server's connections to the app among its descriptors.
        "Memory/A": _per_pod_near(scene, proportional_memory, rel=0.2),
        "CPU/A": _per_pod(0.0, 2.0),
        "File descriptors/A": _per_pod_near(scene, open_fds, abs_=4, low=HELD + 4 * 3),
        "Versions/A": lambda series: _eq({("unknown",): 2}, "tag")(series),
        # Each worker of each pod (two per proxy), idle loops between the test's bursts.
        "Event loop lag (p99)/A": _per_worker(0.0, 0.5),
        "Event loop tasks/A": _per_worker(2, 1000),  # its own channel reader and pusher at least
        "Event loop busy/A": _per_worker(0.0, 1.0),  # one thread: at most a second per second
    }


def test_the_dashboard_is_grafana_json_of_this_projects_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    for p in panels:
        x, w = p["gridPos"]["x"], p["gridPos"]["w"]
        assert x >= 0 and x + w <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and p["description"], p["title"]
    found = (re.findall(r"\b((?:istio|process|ztunnel)_\w+)", e) for e in dashboard_queries().values())
    # A histogram's samples are documented under its family's name.
    names = {re.sub(r"_(bucket|sum|count)$", "", m) for ms in found for m in ms}
    documented = (ROOT / "docs" / "operations.md").read_text()
    # Every family it plots is one docs/operations.md lists (`process_*` as a group).
    missing = {n for n in names if f"`{n}`" not in documented and not n.startswith("process_")}
    assert not missing and "`process_*`" in documented, missing
