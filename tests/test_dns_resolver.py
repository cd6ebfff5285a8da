"""The DNS proxy's authoritative answers as a table: (client, name, type) -> the records a client would
see, or "forwarded" (the resolver is a pure function over the store, so no sockets here); then the
reply message itself (flags, TTL, CNAME, EDNS)."""

from __future__ import annotations

import dataclasses
import ipaddress

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import pytest

from mesh.localconfig import parse_local_config
from mesh.model import NetworkAddress, Workload
from tests.kube_wire import NS, serve
from tests.kube_wire import pod as kube_pod
from ztunnel.dns.forwarder import parse_resolv_conf
from ztunnel.dns.replies import answer
from ztunnel.dns.resolver import (
    FORWARD,
    Authoritative,
    ResolverSettings,
    aliases,
    kube_expansions,
    resolve,
)
from ztunnel.state.store import ProxyState

# The mesh every DNS test uses: clients in ns1 and ns2, services of each kind the proxy answers for.
MESH = """
workloads:
  - {uid: c//Pod/ns1/client, name: client, namespace: ns1, serviceAccount: client,
     trustDomain: cluster.local, workloadIps: ["10.0.0.1"], canonicalName: client-app,
     canonicalRevision: v1}
  - {uid: c//Pod/ns2/client, name: client2, namespace: ns2, serviceAccount: client,
     trustDomain: cluster.local, workloadIps: ["10.0.0.2"]}
  - {uid: c//Pod/ns1/h1, name: h1, namespace: ns1, serviceAccount: h, trustDomain: cluster.local,
     workloadIps: ["10.1.0.1", "fd00::1:1"],
     services: {"ns1/headless.ns1.svc.cluster.local": {80: 80}, "ns1/novip.example": {80: 80}}}
  - {uid: c//Pod/ns1/h2, name: h2, namespace: ns1, serviceAccount: h, trustDomain: cluster.local,
     workloadIps: ["10.1.0.2"], services: {"ns1/headless.ns1.svc.cluster.local": {80: 80}}}
services:
  - {name: web, namespace: ns1, hostname: web.ns1.svc.cluster.local, vips: ["/10.96.0.10", "/fd00::10"],
     ports: {80: 8080}}
  - {name: web, namespace: ns2, hostname: web.ns2.svc.cluster.local, vips: ["/10.96.0.20"], ports: {80: 8080}}
  - {name: v4, namespace: ns1, hostname: v4.ns1.svc.cluster.local, vips: ["/10.96.0.11", "/fd00::11"],
     ports: {80: 80}, ipFamilies: IPv4}
  - {name: v6, namespace: ns1, hostname: v6.ns1.svc.cluster.local, vips: ["/fd00::12"], ports: {80: 80},
     ipFamilies: IPv6}
  - {name: headless, namespace: ns1, hostname: headless.ns1.svc.cluster.local, vips: [], ports: {80: 80}}
  - {name: novip, namespace: ns1, hostname: novip.example, vips: [], ports: {80: 80}}
  - {name: wild, namespace: ns1, hostname: "*.wild.example", vips: ["/240.0.0.3"], ports: {80: 80}}
  - {name: mesh-only, namespace: ns1, hostname: mesh-only.example, vips: ["/240.0.0.1"], ports: {80: 80}}
  - {name: private, namespace: ns2, hostname: private.ns2.svc.cluster.local, vips: ["/10.96.0.30"],
     ports: {80: 80}, visibility: Namespace}
  - {name: shared, namespace: ns3, hostname: shared.example, vips: ["/240.0.1.3"], ports: {80: 80}}
  - {name: shared, namespace: ns4, hostname: shared.example, vips: ["/240.0.1.4"], ports: {80: 80}}
  - {name: canon, namespace: ns3, hostname: canon.example, vips: ["/240.0.2.3"], ports: {80: 80}}
  - {name: canon, namespace: ns4, hostname: canon.example, vips: ["/240.0.2.4"], ports: {80: 80},
     canonical: true}
  - {name: elsewhere, namespace: ns1, hostname: elsewhere.example, vips: ["net2/240.0.3.1"], ports: {80: 80}}
"""

SETTINGS = ResolverSettings(preferred_namespace="ns3")
NO_IPV6 = ResolverSettings(ipv6_enabled=False)
SEARCH = "ns1.svc.cluster.local"


def mesh() -> ProxyState:
    state = ProxyState()
    state.apply_local_config(parse_local_config(MESH))
    return state


def client(state: ProxyState, uid: str = "c//Pod/ns1/client") -> Workload:
    w = state.workload_by_uid(uid)
    assert w is not None
    return w


def seen(result: object) -> object:
    """What the client sees: "forwarded", or (cname target or None, sorted addresses)."""
    if result is FORWARD:
        return "forwarded"
    assert isinstance(result, Authoritative)
    return (
        result.owner if result.owner != result.name else None,
        sorted(str(a) for a in result.addresses),
    )


CASES = [
    # (client, name, type, settings, what the client sees)
    ("ns1", "web.ns1.svc.cluster.local", "A", SETTINGS, (None, ["10.96.0.10"])),
    ("ns1", "web.ns1.svc.cluster.local", "AAAA", SETTINGS, (None, ["fd00::10"])),
    ("ns1", "WEB.ns1.svc.cluster.local", "A", SETTINGS, (None, ["10.96.0.10"])),
    # Kubernetes expansions for the client's namespace.
    ("ns1", "web", "A", SETTINGS, (None, ["10.96.0.10"])),
    ("ns2", "web", "A", SETTINGS, (None, ["10.96.0.20"])),
    ("ns2", "web.ns1", "A", SETTINGS, (None, ["10.96.0.10"])),
    ("ns1", "web.ns1.svc", "A", SETTINGS, (None, ["10.96.0.10"])),
    ("ns1", "web.ns2.svc.cluster", "A", SETTINGS, "forwarded"),
    # A search domain appended by the client's resolver: stripped, answered with a CNAME.
    (
        "ns1",
        "web.ns2.svc.cluster.local.ns1.svc.cluster.local",
        "A",
        SETTINGS,
        ("web.ns2.svc.cluster.local", ["10.96.0.20"]),
    ),
    ("ns1", "web.ns2.ns1.svc.cluster.local", "A", SETTINGS, ("web.ns2", ["10.96.0.20"])),
    ("ns1", "mesh-only.example.svc.cluster.local", "A", SETTINGS, ("mesh-only.example", ["240.0.0.1"])),
    # Wildcards: the asked name owns the records, also when it came through stripping.
    ("ns1", "a.wild.example", "A", SETTINGS, (None, ["240.0.0.3"])),
    ("ns1", "a.b.wild.example", "A", SETTINGS, (None, ["240.0.0.3"])),
    ("ns1", "a.wild.example.cluster.local", "A", SETTINGS, (None, ["240.0.0.3"])),
    ("ns1", "wild.example", "A", SETTINGS, "forwarded"),
    # Headless: the endpoints' first address of the family; a VIP-less non-Kubernetes name is forwarded.
    ("ns1", "headless.ns1.svc.cluster.local", "A", SETTINGS, (None, ["10.1.0.1", "10.1.0.2"])),
    ("ns1", "headless", "AAAA", SETTINGS, (None, ["fd00::1:1"])),
    ("ns1", "novip.example", "A", SETTINGS, "forwarded"),
    # IP families: a known name never gets NXDOMAIN.
    ("ns1", "v4.ns1.svc.cluster.local", "AAAA", SETTINGS, (None, [])),
    ("ns1", "v4.ns1.svc.cluster.local", "A", SETTINGS, (None, ["10.96.0.11"])),
    ("ns1", "v6.ns1.svc.cluster.local", "A", SETTINGS, (None, [])),
    ("ns1", "v6.ns1.svc.cluster.local", "AAAA", SETTINGS, (None, ["fd00::12"])),
    ("ns1", "mesh-only.example", "AAAA", SETTINGS, (None, [])),
    ("ns1", "web.ns1.svc.cluster.local", "AAAA", NO_IPV6, (None, [])),
    # Visibility, network, preference.
    ("ns1", "private.ns2.svc.cluster.local", "A", SETTINGS, "forwarded"),
    ("ns2", "private", "A", SETTINGS, (None, ["10.96.0.30"])),
    ("ns1", "elsewhere.example", "A", SETTINGS, (None, [])),
    ("ns1", "shared.example", "A", SETTINGS, (None, ["240.0.1.3"])),
    ("ns1", "shared.example", "A", ResolverSettings(preferred_namespace="ns4"), (None, ["240.0.1.4"])),
    ("ns1", "shared.example", "A", ResolverSettings(), (None, ["240.0.1.3"])),
    ("ns1", "canon.example", "A", SETTINGS, (None, ["240.0.2.4"])),
    # Not ours: other types, unknown names.
    ("ns1", "web.ns1.svc.cluster.local", "TXT", SETTINGS, "forwarded"),
    ("ns1", "web.ns1.svc.cluster.local", "MX", SETTINGS, "forwarded"),
    ("ns1", "example.com", "A", SETTINGS, "forwarded"),
    ("ns1", "nothere.ns1.svc.cluster.local", "A", SETTINGS, "forwarded"),
]


@pytest.mark.parametrize(("ns", "name", "rdtype", "settings", "expected"), CASES)
def test_resolve(ns: str, name: str, rdtype: str, settings: ResolverSettings, expected: object) -> None:
    state = mesh()
    who = client(state, f"c//Pod/{ns}/client")
    got = resolve(state, who, name.lower(), dns.rdatatype.from_text(rdtype), settings)
    assert seen(got) == expected


def test_dedicated_search_list_is_the_one_given() -> None:
    state = mesh()
    settings = ResolverSettings(search_domains=("corp.example",))
    got = resolve(state, client(state), "web.ns1.corp.example", dns.rdatatype.A, settings)
    assert seen(got) == ("web.ns1", ["10.96.0.10"])
    # The Kubernetes search list is not applied when another one is given.
    got = resolve(state, client(state), "web.ns2.ns1.svc.cluster.local", dns.rdatatype.A, settings)
    assert got is FORWARD


def test_expansions_and_aliases() -> None:
    assert kube_expansions("a", "ns", "cd") == ["a.ns.svc.cd"]
    assert kube_expansions("a.b", "ns", "cd") == ["a.b.svc.cd", "a.b.ns.svc.cd"]
    assert kube_expansions("a.b.svc", "ns", "cd") == ["a.b.svc.cd", "a.b.svc.svc.cd"]
    assert kube_expansions("a.b.c", "ns", "cd") == ["a.b.c.svc.cd"]
    assert kube_expansions("a.b.svc.x", "ns", "cd") == []
    assert kube_expansions("a.b.c.svc", "ns", "cd") == ["a.b.c.svc.cd"]
    names = [(a.name, a.stripped) for a in aliases("a.ns.svc.cluster.local", "ns", ResolverSettings())]
    assert names == [
        ("a.ns.svc.cluster.local", None),
        ("a", "a"),
        ("a.ns", "a.ns"),
        ("a.ns.ns.svc.cluster.local", "a.ns"),
        ("a.ns.svc", "a.ns.svc"),
        ("a.ns.svc.svc.cluster.local", "a.ns.svc"),
    ]


# -- per-pod names of headless services ------------------------------------------------------------

# Pods named by `<pod>.<service>.<ns>.svc.cluster.local`: HOME is the asking client's cluster. db-0 is
# in both namespaces; t3..t0 (each listing ns1's `db`) tell the tie-breaks apart: every name leaves
# out the better candidates of the one above; listed worst first, and their uids (r<rank>//...) sort
# the same way, so that the first seen never wins by chance whichever order the store gets them in. vip-0's service has a VIP, ext-0's is not cluster-local: neither is a pod name.
PODS = """
  - {uid: p//Pod/ns1/db-0, name: db-0, namespace: ns1, serviceAccount: db, trustDomain: cluster.local,
     clusterId: HOME, workloadIps: ["10.2.0.1", "10.2.0.11", "fd00::2:1"],
     services: {"ns1/db.ns1.svc.cluster.local": {5432: 5432}}}
  - {uid: p//Pod/ns2/db-0, name: db-0, namespace: ns2, serviceAccount: db, trustDomain: cluster.local,
     clusterId: HOME, workloadIps: ["10.2.0.2"], services: {"ns2/db.ns2.svc.cluster.local": {5432: 5432}}}
  - {uid: p//Pod/ns1/vip-0, name: vip-0, namespace: ns1, serviceAccount: db, trustDomain: cluster.local,
     clusterId: HOME, workloadIps: ["10.2.0.3"], services: {"ns1/vipdb.ns1.svc.cluster.local": {5432: 5432}}}
  - {uid: p//Pod/ns1/ext-0, name: ext-0, namespace: ns1, serviceAccount: db, trustDomain: cluster.local,
     clusterId: HOME, workloadIps: ["10.2.0.4"], services: {"ns1/ext.example": {5432: 5432}}}
  - {uid: q//Pod/ns1/t3-alone, name: t3, namespace: ns1, serviceAccount: db, trustDomain: cluster.local,
     clusterId: HOME, workloadIps: ["10.3.0.9"]}
  - {uid: r0//Pod/ns2/t3, name: t3, namespace: ns2, serviceAccount: db, trustDomain: cluster.local,
     clusterId: away, workloadIps: ["10.3.0.0"], services: {"ns1/db.ns1.svc.cluster.local": {5432: 5432}}}
  - {uid: r1//Pod/ns1/t3, name: t3, namespace: ns1, serviceAccount: db, trustDomain: cluster.local,
     clusterId: away, workloadIps: ["10.3.0.1"], services: {"ns1/db.ns1.svc.cluster.local": {5432: 5432}}}
  - {uid: r2//Pod/ns2/t3, name: t3, namespace: ns2, serviceAccount: db, trustDomain: cluster.local,
     clusterId: HOME, workloadIps: ["10.3.0.2"], services: {"ns1/db.ns1.svc.cluster.local": {5432: 5432}}}
  - {uid: r3//Pod/ns1/t3, name: t3, namespace: ns1, serviceAccount: db, trustDomain: cluster.local,
     clusterId: HOME, workloadIps: ["10.3.0.3"], services: {"ns1/db.ns1.svc.cluster.local": {5432: 5432}}}
  - {uid: r0//Pod/ns2/t2, name: t2, namespace: ns2, serviceAccount: db, trustDomain: cluster.local,
     clusterId: away, workloadIps: ["10.4.0.0"], services: {"ns1/db.ns1.svc.cluster.local": {5432: 5432}}}
  - {uid: r1//Pod/ns1/t2, name: t2, namespace: ns1, serviceAccount: db, trustDomain: cluster.local,
     clusterId: away, workloadIps: ["10.4.0.1"], services: {"ns1/db.ns1.svc.cluster.local": {5432: 5432}}}
  - {uid: r2//Pod/ns2/t2, name: t2, namespace: ns2, serviceAccount: db, trustDomain: cluster.local,
     clusterId: HOME, workloadIps: ["10.4.0.2"], services: {"ns1/db.ns1.svc.cluster.local": {5432: 5432}}}
  - {uid: r0//Pod/ns1/t1, name: t1, namespace: ns1, serviceAccount: db, trustDomain: cluster.local,
     clusterId: third, workloadIps: ["10.5.0.0"], services: {"ns1/db.ns1.svc.cluster.local": {5432: 5432}}}
  - {uid: r1//Pod/ns1/t1, name: t1, namespace: ns1, serviceAccount: db, trustDomain: cluster.local,
     clusterId: away, workloadIps: ["10.5.0.1"], services: {"ns1/db.ns1.svc.cluster.local": {5432: 5432}}}
  - {uid: r0//Pod/ns2/t0, name: t0, namespace: ns2, serviceAccount: db, trustDomain: cluster.local,
     clusterId: away, workloadIps: ["10.6.0.0"], services: {"ns1/db.ns1.svc.cluster.local": {5432: 5432}}}
  - {uid: r0//Pod/ns3/t0, name: t0, namespace: ns3, serviceAccount: db, trustDomain: cluster.local,
     clusterId: away, workloadIps: ["10.6.0.3"], services: {"ns1/db.ns1.svc.cluster.local": {5432: 5432}}}
  - {uid: e//Pod/evil/web-0, name: web-0, namespace: evil, serviceAccount: web, trustDomain: cluster.local,
     clusterId: HOME, workloadIps: ["10.7.0.66"], services: {"evil/web.shop.svc.cluster.local": {80: 80}}}
  - {uid: e//Pod/evil/web-1, name: web-1, namespace: evil, serviceAccount: web, trustDomain: cluster.local,
     clusterId: HOME, workloadIps: ["10.7.0.67"], services: {"evil/web.shop.svc.cluster.local": {80: 80}}}
  - {uid: e//Pod/evil/web-2, name: web-2, namespace: evil, serviceAccount: web, trustDomain: cluster.local,
     clusterId: HOME, workloadIps: ["10.7.0.68"], services: {"shop/web.shop.svc.cluster.local": {80: 80}}}
  - {uid: s//Pod/shop/web-0, name: web-0, namespace: shop, serviceAccount: web, trustDomain: cluster.local,
     clusterId: HOME, workloadIps: ["10.7.0.1"], services: {"shop/web.shop.svc.cluster.local": {80: 80}}}
  - {uid: p//Pod/ns2/priv-0, name: priv-0, namespace: ns2, serviceAccount: db, trustDomain: cluster.local,
     clusterId: HOME, workloadIps: ["10.8.0.1"], services: {"ns2/private.ns2.svc.cluster.local": {80: 80}}}
"""
# The hijack: a VIP-less service of namespace evil with the hostname of shop's headless service, known
# first. The leak: a headless service of ns2 exported to its own namespace only.
POD_SERVICES = """
  - {name: db, namespace: ns1, hostname: db.ns1.svc.cluster.local, vips: [], ports: {5432: 5432}}
  - {name: db, namespace: ns2, hostname: db.ns2.svc.cluster.local, vips: [], ports: {5432: 5432}}
  - {name: vipdb, namespace: ns1, hostname: vipdb.ns1.svc.cluster.local, vips: ["/10.96.9.9"],
     ports: {5432: 5432}}
  - {name: ext, namespace: ns1, hostname: ext.example, vips: [], ports: {5432: 5432}}
  - {name: web, namespace: evil, hostname: web.shop.svc.cluster.local, vips: [], ports: {80: 80}}
  - {name: web, namespace: shop, hostname: web.shop.svc.cluster.local, vips: [], ports: {80: 80}}
  - {name: private, namespace: ns2, hostname: private.ns2.svc.cluster.local, vips: [], ports: {80: 80},
     visibility: Namespace}
"""


def pods_mesh(home_cluster: str, clients: str) -> str:
    """The local config of PODS beside `clients` (workload entries), HOME being `home_cluster`."""
    return f"workloads:{clients}{PODS.replace('HOME', home_cluster)}services:{POD_SERVICES}"


POD_CLIENTS = """
  - {uid: c//Pod/ns1/client, name: client, namespace: ns1, serviceAccount: client, trustDomain: cluster.local,
     clusterId: home, workloadIps: ["10.0.0.1"]}
  - {uid: c//Pod/ns2/client, name: client, namespace: ns2, serviceAccount: client, trustDomain: cluster.local,
     clusterId: away, workloadIps: ["10.0.0.2"]}
"""

DB0 = "db-0.db.ns1.svc.cluster.local"
POD_CASES = [
    # (client namespace, name, type, settings, what the client sees)
    ("ns1", DB0, "A", SETTINGS, (None, ["10.2.0.1", "10.2.0.11"])),
    ("ns1", DB0, "AAAA", SETTINGS, (None, ["fd00::2:1"])),
    ("ns1", DB0, "AAAA", NO_IPV6, (None, [])),
    ("ns1", "DB-0.db.NS1.svc.cluster.local", "A", SETTINGS, (None, ["10.2.0.1", "10.2.0.11"])),
    # The partial forms, and the short one through the client's namespace.
    ("ns1", "db-0.db.ns1.svc", "A", SETTINGS, (None, ["10.2.0.1", "10.2.0.11"])),
    ("ns1", "db-0.db.ns1", "A", SETTINGS, (None, ["10.2.0.1", "10.2.0.11"])),
    ("ns1", "db-0.db", "A", SETTINGS, (None, ["10.2.0.1", "10.2.0.11"])),
    ("ns2", "db-0.db", "A", SETTINGS, (None, ["10.2.0.2"])),
    ("ns1", "db-0.db.ns2", "A", SETTINGS, (None, ["10.2.0.2"])),
    # A search domain appended by the client's resolver: stripped, answered with a CNAME.
    ("ns1", DB0 + ".ns1.svc.cluster.local", "A", SETTINGS, (DB0, ["10.2.0.1", "10.2.0.11"])),
    ("ns1", "db-0.db.ns1.ns1.svc.cluster.local", "A", SETTINGS, ("db-0.db.ns1", ["10.2.0.1", "10.2.0.11"])),
    # Only a pod of the name's namespace: one of the client's cluster, else the first; a pod of
    # another namespace listing the service is no candidate, even in the client's cluster.
    ("ns1", "t3.db.ns1", "A", SETTINGS, (None, ["10.3.0.3"])),
    ("ns1", "t2.db.ns1", "A", SETTINGS, (None, ["10.4.0.1"])),
    ("ns1", "t1.db.ns1", "A", SETTINGS, (None, ["10.5.0.0"])),
    ("ns1", "t0.db.ns1", "A", SETTINGS, "forwarded"),
    # ... relative to the client asking: ns2 in the other cluster.
    ("ns2", "t3.db.ns1", "A", SETTINGS, (None, ["10.3.0.1"])),
    ("ns2", "t2.db.ns1", "A", SETTINGS, (None, ["10.4.0.1"])),
    ("ns2", "t1.db.ns1", "A", SETTINGS, (None, ["10.5.0.1"])),
    # The hijack: only shop's pod of shop's service answers for it, never evil's lookalike service's
    # pods nor a pod of evil that lists shop's service.
    ("ns1", "web-0.web.shop.svc.cluster.local", "A", SETTINGS, (None, ["10.7.0.1"])),
    ("ns2", "web-0.web.shop", "A", SETTINGS, (None, ["10.7.0.1"])),
    ("ns1", "web-1.web.shop.svc.cluster.local", "A", SETTINGS, "forwarded"),
    ("ns1", "web-2.web.shop.svc.cluster.local", "A", SETTINGS, "forwarded"),
    # The leak: a service visible to its namespace only lends its pods names there only.
    ("ns2", "priv-0.private", "A", SETTINGS, (None, ["10.8.0.1"])),
    ("ns1", "priv-0.private.ns2.svc.cluster.local", "A", SETTINGS, "forwarded"),
    ("ns1", "priv-0.private.ns2", "A", SETTINGS, "forwarded"),
    # Not a pod name: no such pod, a pod not behind that service, a service with a VIP, one that is
    # not cluster-local, a pod name alone, a service name as its own pod.
    ("ns1", "db-9.db.ns1.svc.cluster.local", "A", SETTINGS, "forwarded"),
    ("ns1", "db-0.db.ns3.svc.cluster.local", "A", SETTINGS, "forwarded"),
    ("ns1", "db-0.vipdb.ns1.svc.cluster.local", "A", SETTINGS, "forwarded"),
    ("ns1", "vip-0.vipdb.ns1.svc.cluster.local", "A", SETTINGS, "forwarded"),
    ("ns1", "ext-0.ext.example", "A", SETTINGS, "forwarded"),
    ("ns1", "db-0", "A", SETTINGS, "forwarded"),
    ("ns1", "db-0.ns1.svc.cluster.local", "A", SETTINGS, "forwarded"),
    ("ns1", DB0, "TXT", SETTINGS, "forwarded"),
    # The headless service's own name still means its endpoints.
    ("ns2", "db", "A", SETTINGS, (None, ["10.2.0.2"])),
]


@pytest.mark.parametrize(("ns", "name", "rdtype", "settings", "expected"), POD_CASES)
def test_resolve_pod_names(
    ns: str, name: str, rdtype: str, settings: ResolverSettings, expected: object
) -> None:
    state = ProxyState()
    state.apply_local_config(parse_local_config(pods_mesh("home", POD_CLIENTS)))
    who = client(state, f"c//Pod/{ns}/client")
    got = resolve(state, who, name.lower(), dns.rdatatype.from_text(rdtype), settings)
    assert seen(got) == expected


def test_pod_names_follow_the_store() -> None:
    """The name index follows every change: a pod renamed, removed, its service gaining a VIP, pods
    of one name coming and going."""
    state = ProxyState()
    state.apply_local_config(parse_local_config(pods_mesh("home", POD_CLIENTS)))
    who = client(state)

    def ask(name: str) -> object:
        return seen(resolve(state, who, name, dns.rdatatype.A, SETTINGS))

    db0 = state.workload_by_uid("p//Pod/ns1/db-0")
    assert db0 is not None
    state.upsert_workload(dataclasses.replace(db0, name="db-1"))
    assert ask(DB0) == "forwarded"
    assert ask("db-1.db.ns1.svc.cluster.local") == (None, ["10.2.0.1", "10.2.0.11"])
    state.remove("r3//Pod/ns1/t3")
    assert ask("t3.db.ns1.svc.cluster.local") == (None, ["10.3.0.1"])
    db = state.service_by_key("ns1/db.ns1.svc.cluster.local")
    assert db is not None
    vip = NetworkAddress("", ipaddress.ip_address("10.96.9.10"))
    state.upsert_service(dataclasses.replace(db, vips=(vip,)))
    assert ask("t3.db.ns1.svc.cluster.local") == "forwarded"
    state.upsert_service(db)
    # Two pods of one name, one left, none, one again (updated twice: still one).
    t1 = state.workload_by_uid("r1//Pod/ns1/t1")
    assert t1 is not None
    assert ask("t1.db.ns1") == (None, ["10.5.0.0"])
    state.remove("r0//Pod/ns1/t1")
    assert ask("t1.db.ns1") == (None, ["10.5.0.1"])
    state.remove("r1//Pod/ns1/t1")
    assert ask("t1.db.ns1") == "forwarded"
    state.upsert_workload(t1)
    state.upsert_workload(t1)
    assert state.workloads_by_name("t1") == [t1]
    assert ask("t1.db.ns1") == (None, ["10.5.0.1"])
    state.remove_service("ns1/db.ns1.svc.cluster.local")
    assert ask("db-1.db.ns1.svc.cluster.local") == "forwarded"


def test_statefulset_pods_from_kubernetes_manifests() -> None:
    """What the development control plane makes of a StatefulSet's pods (members of its headless
    Service) is what their names need; a Service with a cluster IP selecting them gives none."""
    manifests = (
        NS
        + kube_pod("client", "10.0.0.1", labels="{app: client}")
        + kube_pod("web-0", "10.0.0.10", labels="{app: web}")
        + kube_pod("web-1", "10.0.0.11", labels="{app: web}")
        + """
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec: {clusterIP: None, selector: {app: web}, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: vip, namespace: demo}
spec: {clusterIP: 10.96.0.50, selector: {app: web}, ports: [{port: 80}]}
"""
    )
    state = ProxyState()
    state.apply_local_config(serve(manifests).index.config)
    [who] = state.workloads_by_name("client")
    for name, expected in [
        ("web-0.web.demo.svc.cluster.local", (None, ["10.0.0.10"])),
        ("web-1.web", (None, ["10.0.0.11"])),
        ("web-0.vip.demo.svc.cluster.local", "forwarded"),
        ("web", (None, ["10.0.0.10", "10.0.0.11"])),
    ]:
        assert seen(resolve(state, who, name, dns.rdatatype.A, SETTINGS)) == expected, name


def test_pod_reply_message() -> None:
    state = ProxyState()
    state.apply_local_config(parse_local_config(pods_mesh("home", POD_CLIENTS)))
    reply = answer(state, client(state), _query("t3.db.ns1.svc.cluster.local.", "A"), SETTINGS)
    assert reply is not None
    assert reply.rcode() == dns.rcode.NOERROR
    assert reply.flags & dns.flags.AA and reply.flags & dns.flags.RA
    [a] = reply.answer
    assert a.name.to_text() == "t3.db.ns1.svc.cluster.local." and a.ttl == 30
    assert [r.address for r in a] == ["10.3.0.3"]


def _query(name: str, rdtype: str, **kw: object) -> dns.message.Message:
    return dns.message.make_query(name, rdtype, **kw)  # type: ignore[arg-type]


def test_reply_message() -> None:
    state = mesh()
    query = _query(
        "web.ns2.svc.cluster.local.ns1.svc.cluster.local.", "A", use_edns=0, payload=4096, want_dnssec=True
    )
    reply = answer(state, client(state), query, SETTINGS)
    assert reply is not None
    assert reply.rcode() == dns.rcode.NOERROR
    assert reply.flags & dns.flags.AA and reply.flags & dns.flags.RA and reply.flags & dns.flags.QR
    assert reply.flags & dns.flags.RD  # copied from the query
    assert reply.edns == 0 and reply.payload == 4096 and reply.ednsflags & dns.flags.DO
    cname, a = reply.answer
    assert cname.rdtype == dns.rdatatype.CNAME and cname.name.to_text() == query.question[0].name.to_text()
    assert cname[0].target.to_text() == "web.ns2.svc.cluster.local."
    assert a.name.to_text() == "web.ns2.svc.cluster.local." and [r.address for r in a] == ["10.96.0.20"]
    assert cname.ttl == a.ttl == 30


def test_reply_small_payload_and_no_edns() -> None:
    state = mesh()
    reply = answer(
        state, client(state), _query("web.ns1.svc.cluster.local.", "A", use_edns=0, payload=100), SETTINGS
    )
    assert reply is not None and reply.payload == 512
    reply = answer(state, client(state), _query("web.ns1.svc.cluster.local.", "A"), SETTINGS)
    assert reply is not None and reply.edns == -1


def test_empty_answer_is_noerror_authoritative() -> None:
    state = mesh()
    reply = answer(state, client(state), _query("v4.ns1.svc.cluster.local.", "AAAA"), SETTINGS)
    assert reply is not None
    assert reply.rcode() == dns.rcode.NOERROR and reply.flags & dns.flags.AA and reply.answer == []


def test_addresses_are_shuffled() -> None:
    state = mesh()
    orders = set()
    for _ in range(50):
        r = resolve(state, client(state), "headless.ns1.svc.cluster.local", dns.rdatatype.A, SETTINGS)
        assert isinstance(r, Authoritative)
        orders.add(r.addresses)
    assert orders == {
        (ipaddress.ip_address("10.1.0.1"), ipaddress.ip_address("10.1.0.2")),
        (ipaddress.ip_address("10.1.0.2"), ipaddress.ip_address("10.1.0.1")),
    }


def test_resolv_conf() -> None:
    conf = parse_resolv_conf(
        "# comment\nnameserver 10.0.0.53\nnameserver fe80::1%eth0\nnameserver bogus\n"
        "search a.example b.example.\noptions ndots:5 timeout:2 attempts:3 rotate\n"
    )
    assert conf.nameservers == (("10.0.0.53", 53), ("fe80::1", 53))
    assert conf.search == ("a.example", "b.example")
    assert (conf.timeout, conf.attempts, conf.rotate) == (2.0, 3, True)
    assert parse_resolv_conf("").nameservers == ()
    assert parse_resolv_conf("").timeout == 5.0
