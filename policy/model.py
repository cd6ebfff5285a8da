"""The authorization model (wire: `istio.security.Authorization`, SPEC §5.1)."""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field

from policy.matchers import NetworkSet, StringSet

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
    # Built once here, so that evaluating a connection never walks a list (`policy.matchers`).
    compiled: CompiledMatch = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compiled", CompiledMatch(self))


def _string_set(patterns: tuple[StringMatch, ...]) -> StringSet:
    by_kind: dict[StringMatchKind, list[str]] = {kind: [] for kind in StringMatchKind}
    for pattern in patterns:
        by_kind[pattern.kind].append(pattern.value)
    return StringSet(
        exact=by_kind[StringMatchKind.EXACT],
        prefixes=by_kind[StringMatchKind.PREFIX],
        suffixes=by_kind[StringMatchKind.SUFFIX],
        presence=bool(by_kind[StringMatchKind.PRESENCE]),
    )


class CompiledMatch:
    """A `Match`'s lists as sets and tries, for `policy.rbac`; `empty` when every list is."""

    __slots__ = (
        "destination_ips",
        "destination_ports",
        "empty",
        "namespaces",
        "not_destination_ips",
        "not_destination_ports",
        "not_namespaces",
        "not_principals",
        "not_service_accounts",
        "not_source_ips",
        "principals",
        "service_accounts",
        "source_ips",
    )

    def __init__(self, m: Match) -> None:
        self.namespaces = _string_set(m.namespaces)
        self.not_namespaces = _string_set(m.not_namespaces)
        self.principals = _string_set(m.principals)
        self.not_principals = _string_set(m.not_principals)
        self.source_ips = NetworkSet(m.source_ips)
        self.not_source_ips = NetworkSet(m.not_source_ips)
        self.destination_ips = NetworkSet(m.destination_ips)
        self.not_destination_ips = NetworkSet(m.not_destination_ips)
        self.destination_ports = frozenset(m.destination_ports)
        self.not_destination_ports = frozenset(m.not_destination_ports)
        self.service_accounts = frozenset((sa.namespace, sa.service_account) for sa in m.service_accounts)
        self.not_service_accounts = frozenset(
            (sa.namespace, sa.service_account) for sa in m.not_service_accounts
        )
        self.empty = not (
            m.namespaces
            or m.not_namespaces
            or m.principals
            or m.not_principals
            or m.source_ips
            or m.not_source_ips
            or m.destination_ips
            or m.not_destination_ips
            or m.destination_ports
            or m.not_destination_ports
            or m.service_accounts
            or m.not_service_accounts
        )


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
