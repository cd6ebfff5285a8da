"""Per-pod names of headless services, as a pod's resolver sees them (root): `dig` over UDP and TCP,
and glibc's `getent` through the search list, against a `ztunnel proxy` in dedicated mode and against
a pod's captured DNS in in-pod mode. The mesh is the resolver table's (tests/test_dns_resolver.py),
the client in ns1 of the default cluster: `<pod>.<service>.<ns>.svc.cluster.local` and its partial
forms answered with the pod's addresses (TTL 30, authoritative), the tie-breaks between pods of one
name, and names that are not a pod's forwarded to ztunnel's own nameserver (a dnsmasq): among them
those a pod of another namespace, or of a service the client does not see, would answer.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.cninode import Pod
from tests.inpod_mesh import Mesh, workload_yaml
from tests.netns import require_tools
from tests.test_dns_inpod import SERVICES, captured, mesh_fixture
from tests.test_dns_proxy import dedicated_dns, getent
from tests.test_dns_resolver import POD_SERVICES, PODS, pods_mesh
from tests.test_dns_server import answers, header

__all__ = ["mesh_fixture"]

pytestmark = [pytest.mark.timeout(180), pytest.mark.root]

HOME = '""'  # the client's cluster: the default one
DB0 = ["10.2.0.1", "10.2.0.11"]
# The upstream knows vip-0's name (its service has a VIP: not a pod name the proxy answers).
UPSTREAM_HOSTS = "192.0.2.50 vip-0.vipdb.ns1.svc.cluster.local\n"

# (name, type, status, authoritative, addresses)
ROWS = [
    ("db-0.db.ns1.svc.cluster.local", "A", "NOERROR", True, DB0),
    ("db-0.db.ns1.svc.cluster.local", "AAAA", "NOERROR", True, ["fd00::2:1"]),
    ("db-0.db.ns1.svc", "A", "NOERROR", True, DB0),
    ("db-0.db.ns1", "A", "NOERROR", True, DB0),
    ("db-0.db.ns2.svc.cluster.local", "A", "NOERROR", True, ["10.2.0.2"]),
    # Ties among the pods of the name's namespace: the client's cluster, then the first.
    ("t3.db.ns1.svc.cluster.local", "A", "NOERROR", True, ["10.3.0.3"]),
    ("t2.db.ns1.svc.cluster.local", "A", "NOERROR", True, ["10.4.0.1"]),
    ("t1.db.ns1.svc.cluster.local", "A", "NOERROR", True, ["10.5.0.0"]),
    # The hijack: shop's own pod, never one of evil's lookalike service (known first).
    ("web-0.web.shop.svc.cluster.local", "A", "NOERROR", True, ["10.7.0.1"]),
    # Forwarded: a pod behind a service with a VIP, a pod that does not exist, pods of other
    # namespaces than the name's (listing its service, or a lookalike of another namespace), and the
    # leak: a pod of a service exported to its own namespace (ns2) only.
    ("vip-0.vipdb.ns1.svc.cluster.local", "A", "NOERROR", False, ["192.0.2.50"]),
    ("db-9.db.ns1.svc.cluster.local", "A", "NXDOMAIN", False, []),
    ("t0.db.ns1.svc.cluster.local", "A", "NXDOMAIN", False, []),
    ("web-1.web.shop.svc.cluster.local", "A", "NXDOMAIN", False, []),
    ("web-2.web.shop.svc.cluster.local", "A", "NXDOMAIN", False, []),
    ("priv-0.private.ns2.svc.cluster.local", "A", "NXDOMAIN", False, []),
]


def check(out: str, name: str, rdtype: str, status: str, authoritative: bool, addresses: list[str]) -> None:
    """dig's `+noall +answer +comments` output against a row: status, AA, TTL 30 on our records."""
    got_status, flags = header(out)
    assert got_status == status, out
    assert ("aa" in flags) is authoritative, out
    records = answers(out)
    assert sorted(data for *_, data in records) == addresses, out
    for owner, ttl, got_type, _ in records:
        assert (owner, got_type) == (name + ".", rdtype), out
        if authoritative:
            assert ttl == "30", out


def dig_args(transport: str, name: str, rdtype: str) -> list[str]:
    tcp = "+tcp" if transport == "tcp" else "+notcp"
    return [tcp, "+tries=1", "+time=3", "+noall", "+answer", "+comments", "+nocookie", name, rdtype]


@pytest.mark.parametrize("transport", ["udp", "tcp"])
def test_dedicated(tmp_path: Path, transport: str) -> None:
    (dig,) = require_tools("dig", hint="Debian package bind9-dnsutils")

    def mesh(ip: str) -> str:
        client = f"""
  - {{uid: t//Pod/ns1/client, name: client, namespace: ns1, serviceAccount: client,
     trustDomain: cluster.local, workloadIps: ["{ip}"]}}"""
        return pods_mesh(HOME, client)

    with dedicated_dns(tmp_path, mesh, UPSTREAM_HOSTS) as (proxy_ip, client_resolv):
        for name, rdtype, *expected in ROWS:
            done = subprocess.run(
                [dig, f"@{proxy_ip}", *dig_args(transport, name, rdtype)],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
            check(done.stdout + done.stderr, name, rdtype, *expected)  # type: ignore[arg-type]
        if transport == "udp":
            # The client's resolver appends its search list's first domain to the short form.
            code, out = getent(client_resolv, "ahostsv4", "db-0.db")
            assert (code, sorted({line.split()[0] for line in out.splitlines()})) == (0, DB0), out


def test_inpod(mesh: Mesh, tmp_path: Path) -> None:
    (dig,) = require_tools("dig", hint="Debian package bind9-dnsutils")

    def config(client: Pod) -> str:
        # The captured pod is the client (the default cluster); the pods beside it are only names.
        return (
            "workloads:\n"
            + workload_yaml(client)
            + PODS.replace("HOME", HOME).lstrip("\n")
            + SERVICES
            + POD_SERVICES.lstrip("\n")
        )

    with captured(mesh, tmp_path, config, UPSTREAM_HOSTS) as pod:
        for transport in ("udp", "tcp"):
            for name, rdtype, *expected in ROWS:
                done = pod.run(
                    dig, "@10.96.0.10", *dig_args(transport, name, rdtype)
                )  # any address: captured
                check(done.stdout + done.stderr, name, rdtype, *expected)  # type: ignore[arg-type]
        # The pod's own resolver, through its search list; dig's too.
        done = pod.run("getent", "ahostsv4", "db-0.db")
        assert sorted({line.split()[0] for line in done.stdout.splitlines()}) == DB0, done.stdout
        done = pod.run(dig, "+short", "+search", "db-0.db", "A")
        assert sorted(done.stdout.split()) == DB0, done.stdout + done.stderr
        assert "vip-0.vipdb.ns1.svc.cluster.local from" in pod.upstream_log.read_text()
