"""Which listeners a proxy of a configuration binds, where, and whether transparently: a pure plan.

`listen_plan` is what `build_proxy` binds, in this order, and what a supervisor checks for port
exclusivity before its workers bind the same addresses with `SO_REUSEPORT`. The DNS proxy is in it
(one entry for its UDP and TCP sockets on one address).
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from ztunnel.config.settings import HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT, Config
from ztunnel.dns import dns_address
from ztunnel.sockets import is_transparent

OUTBOUND = "outbound"
INBOUND = "inbound"
INBOUND_PLAINTEXT = "inbound_plaintext"
SOCKS5 = "socks5"
DNS = "dns"


@dataclass(frozen=True)
class ListenSpec:
    """One listener: its name (as `addresses` and the logs call it), address, and `IP_TRANSPARENT`."""

    name: str
    host: str  # "": the wildcard
    port: int
    transparent: bool


def bind_address(config: Config) -> str | None:
    """The address the proxy binds and dials from: PROXY_BIND_ADDRESS, for dedicated proxies sharing
    a host; a pod's proxy binds the wildcard inside the pod's namespace."""
    return config.proxy_bind_address if config.proxy_mode == "dedicated" else None


def listen_plan(config: Config, *, inbound_only: bool = False) -> tuple[ListenSpec, ...]:
    """The listeners of a proxy of `config`, in binding order.

    `inbound_only`: just HBONE on 15008, for in-pod mode's "self" listener (ztunnel's own workload
    in its own namespace), which never spoofs the client's address. ENABLE_PROXY=false: no TCP
    listener, the DNS proxy still runs."""
    dns_host, dns_port = dns_address(config)
    dns = ListenSpec(DNS, dns_host, dns_port, False)
    if not config.enable_proxy:
        return (dns,) if config.dns_capture and not inbound_only else ()
    host = bind_address(config) or ""
    if inbound_only:
        return (ListenSpec(INBOUND, host, HBONE_PORT, False),)
    transparent = config.enable_orig_src is not False
    plan = [
        ListenSpec(OUTBOUND, host, OUTBOUND_PORT, transparent),
        ListenSpec(INBOUND_PLAINTEXT, host, INBOUND_PLAINTEXT_PORT, transparent),
        ListenSpec(INBOUND, host, HBONE_PORT, transparent),
    ]
    if config.enable_socks5:
        socks5_host, socks5_port = config.socks5_address
        plan.append(ListenSpec(SOCKS5, socks5_host, socks5_port, False))
    if config.dns_capture:
        plan.append(dns)
    return tuple(plan)


def check_transparent(config: Config, spec: ListenSpec, sock: socket.socket) -> None:
    """ENABLE_ORIG_SRC=true is a promise to spoof the client's address: refuse to start when the
    inbound listener did not get IP_TRANSPARENT."""
    if (
        spec.name == INBOUND
        and spec.transparent
        and config.enable_orig_src is True
        and not is_transparent(sock)
    ):
        raise PermissionError(
            errno.EPERM, "ENABLE_ORIG_SRC=true but IP_TRANSPARENT was refused (needs CAP_NET_ADMIN)"
        )
