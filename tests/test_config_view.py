"""`ztunnel config`, the operator's view with istioctl ztunnel-config's subcommands and columns.

Run as a user runs it (`python -m ztunnel config ...`, a process) against live proxies: a dedicated
proxy with worker processes fed a local config, and (root) an in-pod node whose pods hold
connections. The tables are read the way a user reads them: by the header's columns.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tests.apps import loopback_net
from tests.harness import Fleet, Proxy, proxy_env
from tests.inpod_mesh import hold, mesh_fixture, mesh_yaml, start_echo, start_node  # noqa: F401
from tests.waiting import eventually
from ztunnel.admin import configview
from ztunnel.admin.configview import ConfigViewError, admin_url, log_query

pytestmark = pytest.mark.timeout(120)

NET = loopback_net()
PROXY = f"{NET}.2"
ADMIN = f"{PROXY}:15000"  # what a user passes `ztunnel config`

MESH = f"""
workloads:
  - uid: k//v1/Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client
    trustDomain: cluster.local
    workloadIps: ["{NET}.2"]
    protocol: HBONE
    node: node-a
  - uid: k//v1/Pod/demo/server
    name: server
    namespace: demo
    serviceAccount: server
    trustDomain: cluster.local
    workloadIps: ["{NET}.3"]
    protocol: HBONE
    node: node-a
    waypoint: {{destination: "demo/waypoint.demo.svc.cluster.local"}}
    services: {{"demo/server.demo.svc.cluster.local": {{80: 8080}}}}
  - uid: k//v1/Pod/demo/server-2
    name: server-2
    namespace: demo
    serviceAccount: server
    trustDomain: cluster.local
    workloadIps: ["{NET}.4"]
    protocol: HBONE
    node: node-b
    status: Unhealthy
    services: {{"demo/server.demo.svc.cluster.local": {{80: 8080}}}}
  - uid: k//v1/Pod/demo/waypoint
    name: waypoint
    namespace: demo
    serviceAccount: waypoint
    trustDomain: cluster.local
    workloadIps: ["{NET}.5"]
    protocol: HBONE
    node: node-b
    services: {{"demo/waypoint.demo.svc.cluster.local": {{15008: 15008}}}}
  - uid: k//v1/Pod/other/db
    name: db
    namespace: other
    serviceAccount: db
    trustDomain: cluster.local
    workloadIps: ["{NET}.6"]
    protocol: TCP
    node: node-a
    waypoint: {{destination: "/10.96.0.9"}}
services:
  - name: server
    namespace: demo
    hostname: server.demo.svc.cluster.local
    vips: ["/10.96.0.3"]
    ports: {{80: 8080}}
    # The dump lists an unhealthy endpoint only when the service may use it.
    loadBalancer: {{healthPolicy: AllowAll}}
  - name: waypoint
    namespace: demo
    hostname: waypoint.demo.svc.cluster.local
    vips: ["/10.96.0.9"]
    ports: {{15008: 15008}}
policies:
  - name: allow-client
    namespace: demo
    scope: Namespace
    action: Allow
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/client"]
  - name: deny-9999
    namespace: istio-system
    scope: Global
    action: Deny
    dryRun: false
    rules:
      - - - destinationPorts: [9999]
"""


def ztunnel_config(*args: str, netns: str = "") -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ztunnel", "config", *args]
    if netns:
        command = ["ip", "netns", "exec", netns, *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)


def shown(*args: str, netns: str = "") -> str:
    done = ztunnel_config(*args, netns=netns)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return done.stdout


def columns(text: str, headers: list[str]) -> list[dict[str, str]]:
    """The rows of a table as a user reads them: each cell under its header."""
    lines = text.splitlines()
    starts = [lines[0].index(h) for h in headers]
    assert [lines[0][s : s + len(h)] for s, h in zip(starts, headers, strict=True)] == headers, lines[0]
    bounds = [*starts[1:], None]
    return [
        {h: line[s:e].strip() for h, s, e in zip(headers, starts, bounds, strict=True)} for line in lines[1:]
    ]


WORKLOAD = ["NAMESPACE", "POD NAME", "ADDRESS", "NODE", "WAYPOINT", "PROTOCOL"]
SERVICE = ["NAMESPACE", "SERVICE NAME", "SERVICE VIP", "WAYPOINT", "ENDPOINTS"]
CERTIFICATE = ["CERTIFICATE NAME", "TYPE", "STATUS", "VALID CERT", "SERIAL NUMBER", "NOT AFTER", "NOT BEFORE"]
CONNECTIONS = ["WORKLOAD", "DIRECTION", "LOCAL", "REMOTE", "REMOTE TARGET", "PROTOCOL"]


@pytest.fixture(scope="module")
def proxy(module_fleet: Fleet) -> Proxy:
    [p] = module_fleet.start_all(proxy_env(PROXY, "demo/client/client", MESH))
    return p


def config_dump(proxy: Proxy) -> dict[str, Any]:
    return proxy.config_dump()


# -- against a live proxy -------------------------------------------------------------------------


def test_workloads_sorted_with_their_waypoints_named(proxy: Proxy) -> None:
    # The host alone: the admin port is the default, 15000.
    rows = columns(shown("workload", PROXY), WORKLOAD)
    assert rows == [
        {"NAMESPACE": "demo", "POD NAME": "client", "ADDRESS": f"{NET}.2", "NODE": "node-a", "WAYPOINT": "None", "PROTOCOL": "HBONE"},
        {"NAMESPACE": "demo", "POD NAME": "server", "ADDRESS": f"{NET}.3", "NODE": "node-a", "WAYPOINT": "waypoint", "PROTOCOL": "HBONE"},
        {"NAMESPACE": "demo", "POD NAME": "server-2", "ADDRESS": f"{NET}.4", "NODE": "node-b", "WAYPOINT": "None", "PROTOCOL": "HBONE"},
        {"NAMESPACE": "demo", "POD NAME": "waypoint", "ADDRESS": f"{NET}.5", "NODE": "node-b", "WAYPOINT": "None", "PROTOCOL": "HBONE"},
        {"NAMESPACE": "other", "POD NAME": "db", "ADDRESS": f"{NET}.6", "NODE": "node-a", "WAYPOINT": "waypoint", "PROTOCOL": "TCP"},
    ]  # fmt: skip
    # istioctl's filters.
    assert [r["POD NAME"] for r in columns(shown("w", ADMIN, "--workload-namespace", "other"), WORKLOAD)] == [
        "db"
    ]
    assert [
        r["POD NAME"] for r in columns(shown("workloads", ADMIN, "--workload-node", "node-b"), WORKLOAD)
    ] == [
        "server-2",
        "waypoint",
    ]
    assert [r["POD NAME"] for r in columns(shown("workload", ADMIN, "--address", f"{NET}.3"), WORKLOAD)] == [
        "server"
    ]


def test_services_count_healthy_endpoints(proxy: Proxy) -> None:
    assert columns(shown("svc", ADMIN), SERVICE) == [
        {"NAMESPACE": "demo", "SERVICE NAME": "server", "SERVICE VIP": "10.96.0.3", "WAYPOINT": "None", "ENDPOINTS": "1/2"},
        {"NAMESPACE": "demo", "SERVICE NAME": "waypoint", "SERVICE VIP": "10.96.0.9", "WAYPOINT": "None", "ENDPOINTS": "1/1"},
    ]  # fmt: skip
    assert columns(shown("service", ADMIN, "--service-namespace", "other"), SERVICE) == []


def test_policies_aligned_as_istioctl_aligns_them(proxy: Proxy) -> None:
    assert shown("policy", ADMIN) == (
        "NAMESPACE    POLICY NAME  ACTION SCOPE\n"
        "demo         allow-client Allow  Namespace\n"
        "istio-system deny-9999    Deny   Global\n"
    )
    assert shown("pol", ADMIN, "--policy-namespace", "demo").splitlines()[1:] == [
        "demo      allow-client Allow  Namespace"
    ]


def test_certificates_leaf_and_root_with_serials_in_hex(proxy: Proxy) -> None:
    dump = config_dump(proxy)
    (secret,) = dump["certificates"]
    rows = columns(shown("certs", ADMIN), CERTIFICATE)
    chain = [("Leaf", c) for c in secret["certChain"]] + [("Root", c) for c in secret["rootCerts"]]
    assert [r["TYPE"] for r in rows] == ["Leaf", "Root"] == [kind for kind, _ in chain]
    for row, (_, cert) in zip(rows, chain, strict=True):
        assert row["CERTIFICATE NAME"] == "spiffe://cluster.local/ns/demo/sa/client"
        assert (row["STATUS"], row["VALID CERT"]) == ("Available", "true")
        assert int(row["SERIAL NUMBER"], 16) == int(cert["serialNumber"])
        assert (row["NOT AFTER"], row["NOT BEFORE"]) == (cert["expirationTime"], cert["validFrom"])


def test_a_dedicated_proxy_lists_no_connections(proxy: Proxy) -> None:
    # As the reference: workloadState (and so the connections) exists in in-pod mode only.
    assert shown("cons", ADMIN) == "WORKLOAD DIRECTION LOCAL REMOTE REMOTE TARGET PROTOCOL\n"


def test_json_and_yaml_are_the_proxys_own_entries(proxy: Proxy) -> None:
    dump = config_dump(proxy)
    by_name = {w["name"]: w for w in dump["workloads"]}
    got = json.loads(shown("workload", ADMIN, "-o", "json", "--workload-node", "node-b"))
    assert got == [by_name["server-2"], by_name["waypoint"]] or got == [
        by_name["waypoint"],
        by_name["server-2"],
    ]
    assert yaml.safe_load(shown("policy", ADMIN, "-o", "yaml")) == sorted(
        dump["policies"], key=lambda p: (p["namespace"], p["name"])
    )
    everything = yaml.safe_load(shown("all", ADMIN, "-o", "yaml"))
    for key in ("workloads", "services", "policies", "certificates", "config"):
        assert everything[key] == dump[key], key


def test_all_prints_every_summary_and_a_saved_dump_reads_the_same(proxy: Proxy, tmp_path: Path) -> None:
    text = shown("all", ADMIN, "--with-headers")
    titles = [line for line in text.splitlines() if line.startswith("------")]
    assert titles == [
        f"------ {t} ------"
        for t in ("WORKLOAD INFO", "SERVICE INFO", "POLICY INFO", "SECRET INFO", "CONNECTIONS INFO")
    ]
    assert shown("policy", ADMIN) in text
    saved = tmp_path / "dump.json"
    saved.write_text(json.dumps(config_dump(proxy)))
    assert shown("workload", "-f", str(saved)) == shown("workload", ADMIN)
    assert shown("policy", "-f", str(saved)) == shown("policy", ADMIN)


def test_log_lists_changes_and_resets_the_level(proxy: Proxy) -> None:
    # No flags: what istioctl sends (`?level=`); the proxy lists the level and changes nothing.
    assert shown("log", ADMIN) == f"{ADMIN}:\ncurrent log level is info\n\n"
    # istioctl's spellings: `logger:level`, `warning`.
    assert shown("log", ADMIN, "--level", "access:debug,warning") == (
        f"{ADMIN}:\ncurrent log level is warn,access=debug\n\n"
    )
    assert shown("log", ADMIN) == f"{ADMIN}:\ncurrent log level is warn,access=debug\n\n"
    assert shown("log", ADMIN, "-r") == f"{ADMIN}:\ncurrent log level is info\n\n"


def test_the_admin_flag_names_the_proxy_as_the_address_does(proxy: Proxy) -> None:
    """`--admin HOST:PORT`, as the contract names it, beside the positional address: every view."""
    for view in ("workload", "service", "policy", "certificate", "all"):
        assert shown(view, "--admin", ADMIN) == shown(view, ADMIN), view
    assert "current log level is info" in shown("log", "--admin", ADMIN)
    assert shown("workload", ADMIN, "--admin", ADMIN) == shown("workload", ADMIN)
    done = ztunnel_config("workload", f"{NET}.2:1", "--admin", ADMIN)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == (
        f"ztunnel config workload: two admin addresses: '{NET}.2:1' and --admin '{ADMIN}'"
    )


def test_bad_input_fails_with_one_line(proxy: Proxy, tmp_path: Path) -> None:
    def failure(*args: str) -> str:
        done = ztunnel_config(*args)
        assert done.returncode == 1 and done.stdout == "", done
        assert done.stderr.count("\n") == 1, done.stderr
        return done.stderr.strip()

    assert failure("workload", f"{NET}.2:1") == (
        f"ztunnel config workload: cannot reach the admin server at http://{NET}.2:1/config_dump: "
        "[Errno 111] Connection refused"
    )
    assert failure("log", ADMIN, "--level", "loud") == "ztunnel config log: unrecognized logging level: loud"
    assert failure("log", ADMIN, "--level", "debug", "-r") == (
        "ztunnel config log: --level cannot be combined with --reset"
    )
    assert (
        failure("log", ADMIN, "-o", "json")
        == "ztunnel config log: --output is not applicable for this command"
    )
    assert failure("policy", ADMIN, "-o", "xml") == "ztunnel config policy: output format 'xml' not supported"
    assert failure("policy", ADMIN, "-f", "x.json").endswith(
        "at most one of --file or ADDRESS must be passed"
    )
    (tmp_path / "bad.json").write_text("[1]")
    assert failure("policy", "-f", str(tmp_path / "bad.json")) == (
        f"ztunnel config policy: {tmp_path / 'bad.json'}: not a config dump (a JSON list, not an object)"
    )
    assert "current log level is info" in shown("log", ADMIN)  # the refused changes changed nothing


# -- pure parts ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "port", "url"),
    [
        (None, 15000, "http://localhost:15000"),
        ("10.0.0.5", 15000, "http://10.0.0.5:15000"),
        ("10.0.0.5", 16000, "http://10.0.0.5:16000"),
        ("10.0.0.5:16001", 16000, "http://10.0.0.5:16001"),
        (":16001", 15000, "http://localhost:16001"),
        ("[::1]:15001", 15000, "http://[::1]:15001"),
        ("::1", 15000, "http://[::1]:15000"),
        ("http://ztunnel.local:15000/", 1, "http://ztunnel.local:15000"),
    ],
)
def test_admin_address(given: str | None, port: int, url: str) -> None:
    assert admin_url(given, port) == url


@pytest.mark.parametrize("given", ["10.0.0.5:0", "10.0.0.5:http", "[::1]x"])
def test_bad_admin_address(given: str) -> None:
    with pytest.raises(ConfigViewError, match="invalid admin address"):
        admin_url(given, 15000)


@pytest.mark.parametrize(
    ("level", "reset", "query"),
    [
        ("", False, "level="),
        ("", True, "reset"),
        ("debug", False, "level=debug"),
        ("warning", False, "level=warn"),
        ("critical", False, "level=error"),
        ("access:debug,info", False, "level=access=debug,info"),
        ("access=off", False, "level=access=off"),
        ("ztunnel::proxy:trace", False, "level=ztunnel::proxy=trace"),  # `::`: the logger's path
    ],
)
def test_log_query(level: str, reset: bool, query: str) -> None:
    assert log_query(level, reset) == query


CONNECTION_DUMP: dict[str, Any] = {
    "workloads": [
        {"name": "a", "namespace": "ns", "workloadIps": ["10.0.0.1"]},
        {"name": "b", "namespace": "ns", "workloadIps": ["10.0.0.2"]},
    ],
    "services": [{"name": "b", "namespace": "ns", "hostname": "b.ns.svc", "vips": ["/10.96.0.2"]}],
    "workloadState": {
        "uid-b": {
            "state": "Up",
            "info": {"name": "b", "namespace": "ns", "serviceAccount": "b"},
            "connections": {
                "inbound": [
                    {
                        "src": "10.0.0.1:40000",
                        "originalDst": "b.ns.svc",
                        "actualDst": "10.0.0.2:80",
                        "protocol": "HBONE",
                    },
                    {
                        "src": "10.0.0.1:40002",
                        "originalDst": None,  # addressed to the pod, or plaintext
                        "actualDst": "10.0.0.2:80",
                        "protocol": "TCP",
                    },
                ],
                "outbound": [],
            },
        },
        "uid-a": {
            "state": "Up",
            "info": {"name": "a", "namespace": "ns", "serviceAccount": "a"},
            "connections": {
                "inbound": [],
                "outbound": [
                    {
                        "src": "10.0.0.1:40000",
                        "originalDst": "10.96.0.2:80",
                        "actualDst": "10.0.0.2:15008",
                        "protocol": "HBONE",
                    },
                    {
                        "src": "10.0.0.1:40001",
                        "originalDst": "192.0.2.1:443",
                        "actualDst": "192.0.2.1:443",
                        "protocol": "TCP",
                    },
                    {
                        "src": "10.0.0.1:40003",
                        "originalDst": "10.96.0.2:80",
                        "actualDst": "192.0.2.9:15008",
                        "protocol": "DOUBLEHBONE",
                    },
                ],
            },
        },
    },
}


def connections(**options: Any) -> list[dict[str, str]]:
    flt = configview.ConnectionsFilter(**options)
    return columns(configview.connection_table(CONNECTION_DUMP, flt), CONNECTIONS)


def test_connections_name_the_addresses_they_know() -> None:
    assert connections() == [
        {"WORKLOAD": "a.ns", "DIRECTION": "Outbound", "LOCAL": "a.ns:40000", "REMOTE": "b.ns:15008", "REMOTE TARGET": "b.ns.svc:80", "PROTOCOL": "HBONE"},
        {"WORKLOAD": "a.ns", "DIRECTION": "Outbound", "LOCAL": "a.ns:40001", "REMOTE": "192.0.2.1:443", "REMOTE TARGET": "192.0.2.1:443", "PROTOCOL": "TCP"},
        {"WORKLOAD": "a.ns", "DIRECTION": "Outbound", "LOCAL": "a.ns:40003", "REMOTE": "192.0.2.9:15008", "REMOTE TARGET": "b.ns.svc:80", "PROTOCOL": "DOUBLEHBONE"},
        {"WORKLOAD": "b.ns", "DIRECTION": "Inbound", "LOCAL": "b.ns:80", "REMOTE": "a.ns:40000", "REMOTE TARGET": "b.ns.svc", "PROTOCOL": "HBONE"},
        {"WORKLOAD": "b.ns", "DIRECTION": "Inbound", "LOCAL": "b.ns:80", "REMOTE": "a.ns:40002", "REMOTE TARGET": "", "PROTOCOL": "TCP"},
    ]  # fmt: skip
    raw = connections(raw=True)
    assert [(r["LOCAL"], r["REMOTE"]) for r in raw] == [
        ("10.0.0.1:40000", "10.0.0.2:15008"),
        ("10.0.0.1:40001", "192.0.2.1:443"),
        ("10.0.0.1:40003", "192.0.2.9:15008"),
        ("10.0.0.2:80", "10.0.0.1:40000"),
        ("10.0.0.2:80", "10.0.0.1:40002"),
    ]
    assert [r["DIRECTION"] for r in connections(direction="inbound")] == ["Inbound", "Inbound"]
    assert [r["WORKLOAD"] for r in connections(workload="b.ns")] == ["b.ns", "b.ns"]
    assert [r["WORKLOAD"] for r in connections(workload="A", namespace="ns")] == ["a.ns"] * 3
    assert connections(namespace="other") == []


def test_certificate_rows_of_every_state() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    cert = {
        "serialNumber": "255",
        "validFrom": "2029-01-01T00:00:00Z",
        "expirationTime": "2031-01-01T00:00:00Z",
    }
    old = {
        "serialNumber": "16",
        "validFrom": "2020-01-01T00:00:00Z",
        "expirationTime": "2021-01-01T00:00:00Z",
    }
    dump = {
        "certificates": [
            {
                "identity": "spiffe://td/ns/a/sa/a",
                "state": "Available",
                "certChain": [cert, cert],
                "rootCerts": [old],
            },
            {"identity": "spiffe://td/ns/b/sa/b", "state": "Available", "certChain": [cert, cert, old]},
            {"identity": "spiffe://td/ns/c/sa/c", "state": "Unavailable: CA refused", "certChain": []},
            {"identity": "spiffe://td/ns/d/sa/d", "state": "Initializing", "certChain": [], "rootCerts": []},
        ]
    }
    rows = columns(configview.certificate_table(dump, now), CERTIFICATE)
    assert [
        (r["CERTIFICATE NAME"][-1], r["TYPE"], r["STATUS"], r["VALID CERT"], r["SERIAL NUMBER"]) for r in rows
    ] == [
        ("a", "Leaf", "Available", "true", "ff"),
        ("a", "Intermediate", "Available", "true", "ff"),
        ("a", "Root", "Available", "false", "10"),
        ("b", "Leaf", "Available", "true", "ff"),
        ("b", "Intermediate", "Available", "true", "ff"),
        ("b", "Root", "Available", "false", "10"),  # an old dump: the root last in the chain
        ("c", "NA", "Unavailable", "false", "NA"),
        ("d", "NA", "Initializing", "false", "NA"),
    ]


def test_every_view_renders_a_map_shaped_dump_too() -> None:
    # Dumps keyed by uid (as istioctl also accepts) read as their values.
    dump = {
        "workloads": {"u": {"name": "a", "namespace": "ns", "workloadIps": ["10.0.0.1"], "protocol": "TCP"}}
    }
    args = SimpleNamespace(output="short", address="", workload_node="", workload_namespace="")
    assert columns(configview.render("workload", dump, args), WORKLOAD)[0]["POD NAME"] == "a"


# -- in-pod mode (root): a node's pods holding connections ------------------------------------------


@pytest.mark.root
def test_connections_of_an_in_pod_node_through_both_workers(mesh: Any) -> None:

    node = mesh.cluster.nodes[0]
    zt = start_node(mesh, node, mesh.xds, POOL_MAX_STREAMS_PER_CONNECTION="1")
    client = node.add_pod("client", service_account="client")
    server = node.add_pod("server", service_account="server")
    mesh.push(mesh_yaml([client, server]))
    mesh.wait_for_workloads(zt, [client, server])
    mesh.apps.append(start_echo(server))
    hold(mesh, client, server, 3)

    def rows(*flags: str) -> list[dict[str, str]]:
        return columns(shown("connections", "127.0.0.1", *flags, netns=node.ns.name), CONNECTIONS)

    eventually(lambda: len(rows()) == 6, lambda: f"three connections each way: {rows()}")
    got = rows()
    outbound = [r for r in got if r["DIRECTION"] == "Outbound"]
    inbound = [r for r in got if r["DIRECTION"] == "Inbound"]
    assert {r["WORKLOAD"] for r in outbound} == {"client.default"}
    assert {r["WORKLOAD"] for r in inbound} == {"server.default"}
    for r in outbound:
        assert r["LOCAL"].startswith("client.default:") and r["PROTOCOL"] == "HBONE", r
        assert (r["REMOTE"], r["REMOTE TARGET"]) == ("server.default:15008", "server.default:8080"), r
    for r in inbound:
        assert (r["LOCAL"], r["PROTOCOL"]) == ("server.default:8080", "HBONE"), r
        assert r["REMOTE"].startswith("client.default:"), r
        # The client addressed the pod, not a service: no `forwarded` host, so no target (the
        # dump's `originalDst` is null, as the reference writes it).
        assert r["REMOTE TARGET"] == "", r
    raw = rows("--raw", "--direction", "inbound")
    assert len(raw) == 3 and {r["LOCAL"] for r in raw} == {f"{server.ip}:8080"}, raw
    assert {r["WORKLOAD"] for r in rows("--workload-namespace", "other")} == set()
