"""Socket addresses as the tunnel writes them: canonical hosts and the one `ip:port` formatter.

An HBONE `:authority` is `ip:port`, or `[v6]:port` for IPv6; the same text appears in logs, metrics
labels and `/config_dump`, so every part of the proxy formats addresses here. An IPv4-mapped IPv6
address (`::ffff:10.0.0.1`, what a dual-stack socket reports) stands for the IPv4 one.
"""

from __future__ import annotations

import functools
import ipaddress
from typing import Any

Address = tuple[str, int]


@functools.lru_cache(maxsize=4096)
def parse_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address's text as an address object, parsed once per distinct address (a node's
    connections name a few)."""
    return ipaddress.ip_address(text)


@functools.lru_cache(maxsize=4096)
def canonical_host(host: str) -> str:
    """An IP address's canonical text (IPv4-mapped IPv6 becomes IPv4, a zone is dropped); any other
    host text is returned unchanged."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def canonical_addr(addr: Any) -> Address:
    """(host, port) of a socket address (2- or 4-tuple), with its host made canonical; ("", 0) for none."""
    if not addr:
        return ("", 0)
    return canonical_host(str(addr[0])), int(addr[1])


def format_addr(host: object, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets. `host` is an address object or its text, or a name."""
    text = str(host)
    return f"[{text}]:{port}" if ":" in text else f"{text}:{port}"
