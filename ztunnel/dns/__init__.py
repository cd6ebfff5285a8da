"""The DNS proxy (one server per proxy instance): authoritative A/AAAA answers for the mesh's
services (`resolver`), forwarding of everything else to ztunnel's own nameservers (`forwarder`),
and the UDP and TCP server with its cache of ready answers (`server`, with the reply messages of
`replies`). dnspython is loaded with the server, by a proxy that runs one (DNS capture on).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ztunnel.config.settings import Config
from ztunnel.dns.forwarder import RESOLV_CONF, Forwarder, read_resolv_conf
from ztunnel.dns.resolver import ResolverSettings
from ztunnel.metrics.families import Metrics
from ztunnel.sockets import SocketFactory
from ztunnel.state.store import ProxyState

if TYPE_CHECKING:
    from ztunnel.dns.server import ClientWorkload, DnsServer

__all__ = ["DnsServer", "dns_address", "dns_on_ipv6_loopback", "dns_server", "resolver_settings"]


def __getattr__(name: str) -> Any:
    if name == "DnsServer":  # the server's module (and dnspython) only when asked for
        from ztunnel.dns.server import DnsServer

        return DnsServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dns_address(config: Config) -> tuple[str, int]:
    """`ISTIO_META_DNS_PROXY_ADDR`, default 127.0.0.1:15053; a dedicated proxy given a
    PROXY_BIND_ADDRESS (several proxies on one host) defaults to that address instead (ours)."""
    bind = config.proxy_bind_address
    explicit = "DNS_PROXY_ADDR" in config.istio_meta
    if not explicit and config.proxy_mode == "dedicated" and bind and bind not in ("0.0.0.0", "::"):
        return bind, config.dns_proxy_addr[1]
    return config.dns_proxy_addr


def dns_on_ipv6_loopback(config: Config) -> bool:
    """Whether the DNS proxy also listens on `[::1]`: as the reference's `localhost:15053` (the
    default, or `DNS_PROXY_ADDR=localhost:<port>`) with IPv6 enabled; never beside an explicit
    address or a dedicated proxy's own bind address."""
    explicit = config.istio_meta.get("DNS_PROXY_ADDR")
    localhost = explicit is None or explicit.strip().lower().startswith("localhost:")
    return config.ipv6_enabled and localhost and dns_address(config)[0] == "127.0.0.1"


def resolver_settings(config: Config, search: tuple[str, ...]) -> ResolverSettings:
    """In-pod, the client's Kubernetes search list is stripped; a dedicated proxy strips `search`,
    the list of its own resolv.conf."""
    return ResolverSettings(
        cluster_domain=config.cluster_domain,
        search_domains=None if config.proxy_mode == "shared" else search,
        ipv6_enabled=config.ipv6_enabled,
        preferred_namespace=config.prefered_service_namespace,
    )


def dns_server(
    config: Config,
    state: ProxyState,
    client: ClientWorkload,
    sockets: SocketFactory,
    metrics: Metrics,
    resolv_conf: str = RESOLV_CONF,
) -> DnsServer:
    """The DNS server of one proxy instance, forwarding to the nameservers of `resolv_conf`."""
    from ztunnel.dns.server import DnsServer

    upstream = read_resolv_conf(resolv_conf)
    return DnsServer(
        dns_address(config),
        state,
        client,
        sockets,
        metrics.dns(),
        Forwarder(upstream, sockets),
        resolver_settings(config, upstream.search),
        loopback_v6=dns_on_ipv6_loopback(config),
    )
