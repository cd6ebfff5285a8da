"""The authorization model (wire: `istio.security.Authorization`, SPEC §5.1)."""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class Scope(enum.IntEnum):
    GLOBAL = 0
    NAMESPACE = 1
    WORKLOAD_SELECTOR = 2


class Action(enum.IntEnum):
    ALLOW = 0
    DENY = 1


class StringMatchKind(enum.Enum):
    EXACT = "Exact"
    PREFIX = "Prefix"
    SUFFIX = "Suffix"
    PRESENCE = "Presence"


@dataclass(frozen=True, slots=True)
class StringMatch:
    kind: StringMatchKind
    value: str = ""  # unused for PRESENCE


@dataclass(frozen=True, slots=True)
class ServiceAccountMatch:
    namespace: str
    service_account: str


@dataclass(frozen=True, slots=True)
class Match:
    """One match entry: every (positive, negative) field pair must pass (SPEC §5.4)."""

    namespaces: tuple[StringMatch, ...] = ()
    not_namespaces: tuple[StringMatch, ...] = ()
    principals: tuple[StringMatch, ...] = ()
    not_principals: tuple[StringMatch, ...] = ()
    source_ips: tuple[IPNetwork, ...] = ()
    not_source_ips: tuple[IPNetwork, ...] = ()
    destination_ips: tuple[IPNetwork, ...] = ()
    not_destination_ips: tuple[IPNetwork, ...] = ()
    destination_ports: tuple[int, ...] = ()
    not_destination_ports: tuple[int, ...] = ()
    service_accounts: tuple[ServiceAccountMatch, ...] = ()
    not_service_accounts: tuple[ServiceAccountMatch, ...] = ()


# A rule is an AND of clauses; a clause is an OR of matches.
Clause = tuple[Match, ...]
Rule = tuple[Clause, ...]


@dataclass(frozen=True, slots=True)
class Authorization:
    name: str
    namespace: str
    scope: Scope = Scope.NAMESPACE
    action: Action = Action.ALLOW
    rules: tuple[Rule, ...] = ()  # OR-ed
    dry_run: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Connection:
    """What authorization sees of a connection. The source identity is given as its parts so that
    this package needs no SPIFFE parser: `src_principal` is the full `spiffe://...` URI or None."""

    src_ip: IPAddress
    src_port: int
    dst_ip: IPAddress
    dst_port: int
    src_principal: str | None = None
    src_namespace: str | None = None
    src_service_account: str | None = None
    dst_network: str = ""
