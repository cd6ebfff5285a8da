"""The DNS proxy (one server per proxy instance): authoritative A/AAAA answers for the mesh's
services (`resolver`), forwarding of everything else to ztunnel's own nameservers (`forwarder`),
and the UDP and TCP server with its cache of ready answers (`server`).
"""

from __future__ import annotations

from ztunnel.config import Config
from ztunnel.dns.forwarder import RESOLV_CONF, Forwarder, read_resolv_conf
from ztunnel.dns.resolver import ResolverSettings
from ztunnel.dns.server import ClientWorkload, DnsServer
from ztunnel.metrics import Metrics
from ztunnel.sockets import SocketFactory
from ztunnel.state import ProxyState

__all__ = ["DnsServer", "dns_server"]


def dns_server(
    config: Config,
    state: ProxyState,
    client: ClientWorkload,
    sockets: SocketFactory,
    metrics: Metrics,
    resolv_conf: str = RESOLV_CONF,
) -> DnsServer:
    """The DNS server of one proxy instance, configured as the reference's: in-pod, the client's
    Kubernetes search list is stripped; a dedicated proxy strips the search list of its resolv.conf."""
    upstream = read_resolv_conf(resolv_conf)
    settings = ResolverSettings(
        cluster_domain=config.cluster_domain,
        search_domains=None if config.proxy_mode == "shared" else upstream.search,
        ipv6_enabled=config.ipv6_enabled,
        preferred_namespace=config.prefered_service_namespace,
    )
    return DnsServer(
        config.dns_proxy_addr, state, client, sockets, metrics.dns(), Forwarder(upstream, sockets), settings
    )
