"""What the DNS proxy answers itself: A and AAAA for names of known services and for the per-pod
names of headless services, as a pure function of the state store, the client's workload and the
question.

`resolve` names the outcome (`Authoritative` records or `FORWARD`); `replies.answer` turns it into
the reply message. This module needs no DNS library: a SOCKS5 listener resolves a host name with it
in a proxy that runs no DNS server (and so never loads dnspython). Names are tried as asked, as their
Kubernetes expansions for the client's namespace, and with a search domain stripped (then the reply
carries a CNAME from the asked name to the stripped one); each candidate as a service's hostname,
then as wildcards of decreasing specificity, then as `<pod>.<svc>.<ns>.svc.<domain>` (a pod of `<ns>`
in that headless service of `<ns>`, which the client sees). A known name never gets NXDOMAIN: no
address of the asked family is NOERROR with an empty answer.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from mesh.model import IPAddress, IPFamilies, Service, Workload
from ztunnel.state.store import ProxyState, visible_to

# The record types answered here (RFC 1035's A, RFC 3596's AAAA).
RDTYPE_A: Final = 1
RDTYPE_AAAA: Final = 28


@dataclass(frozen=True, slots=True)
class ResolverSettings:
    """What the resolver needs of the configuration."""

    cluster_domain: str = "cluster.local"
    # Stripped from asked names; None: the client's Kubernetes search list (in-pod mode).
    search_domains: tuple[str, ...] | None = None
    ipv6_enabled: bool = True
    preferred_namespace: str | None = None


@dataclass(frozen=True, slots=True)
class Alias:
    name: str
    stripped: str | None = None  # the asked name with a search domain stripped, when it came from one


@dataclass(frozen=True, slots=True)
class Authoritative:
    """A reply of our own: `addresses` owned by `owner`, after a CNAME `name -> owner` when they differ."""

    name: str  # as asked, lowercase, no trailing dot
    owner: str
    addresses: tuple[IPAddress, ...]
    # What the name means (None: the record type is not served for this name).
    host: Service | Workload | None = None


class _Forward:
    def __repr__(self) -> str:
        return "FORWARD"


FORWARD: Final = _Forward()
Resolution = Authoritative | _Forward


def search_domains(namespace: str, settings: ResolverSettings) -> tuple[str, ...]:
    if settings.search_domains is not None:
        return settings.search_domains
    cd = settings.cluster_domain
    return (f"{namespace}.svc.{cd}", f"svc.{cd}", cd)


def kube_expansions(name: str, namespace: str, cluster_domain: str) -> list[str]:
    """The Kubernetes names a short name may stand for, for a client in `namespace`."""
    labels = name.split(".")
    cd = cluster_domain
    if len(labels) == 1:
        return [f"{name}.{namespace}.svc.{cd}"]
    if len(labels) == 2:
        return [f"{name}.svc.{cd}", f"{name}.{namespace}.svc.{cd}"]
    if len(labels) == 3:
        out = [f"{labels[0]}.{labels[1]}.svc.{cd}"] if labels[2] == "svc" else []
        return [*out, f"{name}.svc.{cd}"]
    if len(labels) == 4 and labels[3] == "svc":
        return [f"{name}.{cd}"]
    return []


def aliases(name: str, namespace: str, settings: ResolverSettings) -> list[Alias]:
    """The candidate names for `name` (lowercase, no trailing dot), deduplicated, in the order tried."""
    out: dict[str, Alias] = {}

    def add(alias: Alias) -> None:
        out.setdefault(alias.name, alias)

    add(Alias(name))
    for expanded in kube_expansions(name, namespace, settings.cluster_domain):
        add(Alias(expanded))
    for domain in search_domains(namespace, settings):
        if not name.endswith("." + domain):
            continue
        stripped = name[: -len(domain) - 1]
        add(Alias(stripped, stripped))
        for expanded in kube_expansions(stripped, namespace, settings.cluster_domain):
            add(Alias(expanded, stripped))
    return list(out.values())


def wildcards(name: str) -> list[str]:
    """`a.b.c` -> `*.b.c`, `*.c`: the wildcard hostnames that cover it, most specific first."""
    labels = name.split(".")
    return ["*." + ".".join(labels[i:]) for i in range(1, len(labels))]


def find_host(
    state: ProxyState, client: Workload, name: str, settings: ResolverSettings
) -> tuple[Service | Workload, Alias, str] | None:
    """What a name means to this client: (a service or a pod, the alias that matched, the name
    matched: a service's hostname, a wildcard, or the alias itself for a pod)."""
    headless_suffix = f".svc.{settings.cluster_domain}"

    def candidate(s: Service) -> bool:
        # A service with no VIP is answerable only as a headless Kubernetes service (from its endpoints).
        return bool(s.vips) or s.hostname.endswith(headless_suffix)

    for alias in aliases(name, client.namespace, settings):
        for hostname in (alias.name, *wildcards(alias.name)):
            service = state.service_by_hostname(
                hostname, client.namespace, settings.preferred_namespace, candidate=candidate
            )
            if service is not None:
                return service, alias, hostname
        pod = find_pod(state, client, alias.name, headless_suffix)
        if pod is not None:
            return pod, alias, alias.name
    return None


def find_pod(state: ProxyState, client: Workload, name: str, headless_suffix: str) -> Workload | None:
    """`<pod>.<svc>.<ns>.svc.<domain>`: a workload named `<pod>` of namespace `<ns>` that is a member
    of the service `<ns>/<svc>.<ns>.svc.<domain>` itself, when that service has no VIP (a headless
    Kubernetes service) and is visible to the client; one of the client's cluster first, else the
    first. No other service or namespace lends a pod this name."""
    pod, dot, hostname = name.partition(".")
    if not dot or not hostname.endswith(headless_suffix):
        return None
    svc, dot, ns = hostname[: -len(headless_suffix)].partition(".")
    if not svc or not dot or not ns or "." in ns:
        return None
    key = f"{ns}/{hostname}"
    service = state.service_by_key(key)
    if service is None or service.vips or not visible_to(service, client.namespace):
        return None
    best: Workload | None = None
    for w in state.workloads_by_name(pod):
        if w.namespace != ns or not any(k == key for k, _ in w.services):
            continue
        if w.cluster_id == client.cluster_id:
            return w
        if best is None:
            best = w
    return best


def _family_ok(ip: IPAddress, rdtype: int) -> bool:
    return ip.version == (4 if rdtype == RDTYPE_A else 6)


def addresses_of(
    state: ProxyState, host: Service | Workload, client: Workload, rdtype: int
) -> list[IPAddress]:
    if isinstance(host, Workload):  # a pod: every address of the family
        return [a for a in host.addresses if _family_ok(a, rdtype)]
    if host.vips:
        return [v.address for v in host.vips if v.network == client.network and _family_ok(v.address, rdtype)]
    out: list[IPAddress] = []
    for endpoint in state.endpoints(host.key):
        w = state.workload_by_uid(endpoint.workload_uid)
        if w is None:
            continue
        ip = next((a for a in w.addresses if _family_ok(a, rdtype)), None)
        if ip is not None:
            out.append(ip)
    return out


def _served(host: Service | Workload, rdtype: int, settings: ResolverSettings) -> bool:
    """AAAA only with IPv6 enabled; a service's IP families, when it has them, restrict it further."""
    if rdtype == RDTYPE_AAAA and not settings.ipv6_enabled:
        return False
    if isinstance(host, Workload):
        return True
    wanted = IPFamilies.IPV4_ONLY if rdtype == RDTYPE_AAAA else IPFamilies.IPV6_ONLY
    return host.ip_families is not wanted


def resolve(
    state: ProxyState,
    client: Workload,
    name: str,
    rdtype: int,
    settings: ResolverSettings,
    shuffle: Callable[[list[IPAddress]], None] = random.shuffle,
) -> Resolution:
    """Our answer to `name` (lowercase, no trailing dot) of type `rdtype`, or FORWARD."""
    if rdtype not in (RDTYPE_A, RDTYPE_AAAA):
        return FORWARD
    found = find_host(state, client, name, settings)
    if found is None:
        return FORWARD
    host, alias, matched = found
    if not _served(host, rdtype, settings):
        return Authoritative(name, name, ())
    addresses = addresses_of(state, host, client, rdtype)
    shuffle(addresses)
    owner = alias.stripped if alias.stripped is not None and not matched.startswith("*.") else name
    return Authoritative(name, owner, tuple(addresses), host)
