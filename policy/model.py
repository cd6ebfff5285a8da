"""The authorization model (wire: `istio.security.Authorization`)."""

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
    """One match entry: every (positive, negative) field pair must pass."""

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
    # Built on first use (`compiled_match`); an Authorization builds those of its entries when made.
    compiled: CompiledMatch | None = field(default=None, init=False, repr=False, compare=False)


MATCH_FIELDS = tuple(f for f in Match.__dataclass_fields__ if f != "compiled")
# Positive fields: an entry with only one of them set is merged with its like in the clause (below).
_MERGEABLE = frozenset(
    ("namespaces", "principals", "source_ips", "destination_ips", "destination_ports", "service_accounts")
)
_NO_NETWORKS = NetworkSet(())
_NO_STRINGS = StringSet((), (), (), presence=False)
_NOTHING: frozenset[object] = frozenset()


def _string_set(patterns: tuple[StringMatch, ...]) -> StringSet:
    if not patterns:
        return _NO_STRINGS
    exact, prefixes, suffixes = [], [], []
    presence = False
    for pattern in patterns:
        if pattern.kind is StringMatchKind.EXACT:
            exact.append(pattern.value)
        elif pattern.kind is StringMatchKind.PREFIX:
            prefixes.append(pattern.value)
        elif pattern.kind is StringMatchKind.SUFFIX:
            suffixes.append(pattern.value)
        else:
            presence = True
    return StringSet(exact, prefixes, suffixes, presence)


def _networks(networks: tuple[IPNetwork, ...]) -> NetworkSet:
    return NetworkSet(networks) if networks else _NO_NETWORKS


def _accounts(accounts: tuple[ServiceAccountMatch, ...]) -> frozenset[tuple[str, str]]:
    return frozenset((sa.namespace, sa.service_account) for sa in accounts)


class CompiledMatch:
    """A `Match`'s lists as sets, for `policy.rbac` (which reads a list's set only when the list is
    not empty)."""

    __slots__ = (
        "destination_ips",
        "destination_ports",
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
        self.source_ips = _networks(m.source_ips)
        self.not_source_ips = _networks(m.not_source_ips)
        self.destination_ips = _networks(m.destination_ips)
        self.not_destination_ips = _networks(m.not_destination_ips)
        self.destination_ports = frozenset(m.destination_ports) if m.destination_ports else _NOTHING
        self.not_destination_ports = (
            frozenset(m.not_destination_ports) if m.not_destination_ports else _NOTHING
        )
        self.service_accounts = _accounts(m.service_accounts) if m.service_accounts else _NOTHING
        self.not_service_accounts = _accounts(m.not_service_accounts) if m.not_service_accounts else _NOTHING


def compiled_match(m: Match) -> CompiledMatch:
    compiled = m.compiled
    if compiled is None:
        compiled = CompiledMatch(m)
        object.__setattr__(m, "compiled", compiled)
    return compiled


class CompiledClause:
    """A clause (an OR of entries) for `policy.rbac`. Entries with a single positive field set (the
    usual shape of a big policy: one entry per CIDR or per principal) are merged into one set per
    field, so that a clause of 100k such entries costs a few lookups; the others are kept, compiled.
    Empty entries are dropped: they never make a clause match. `always`: a clause without entries."""

    __slots__ = (
        "always",
        "destination_ips",
        "destination_ports",
        "entries",
        "namespaces",
        "principals",
        "service_accounts",
        "source_ips",
    )

    def __init__(self, clause: tuple[Match, ...]) -> None:
        self.always = not clause
        merged: dict[str, list[object]] = {}
        entries: list[Match] = []
        for m in clause:
            present = [name for name in MATCH_FIELDS if getattr(m, name)]
            if len(present) == 1 and present[0] in _MERGEABLE:
                merged.setdefault(present[0], []).extend(getattr(m, present[0]))
            elif present:
                compiled_match(m)
                entries.append(m)
        self.entries = tuple(entries)

        def get(name: str) -> tuple[object, ...] | None:
            return tuple(merged[name]) if name in merged else None

        namespaces, principals = get("namespaces"), get("principals")
        source_ips, destination_ips = get("source_ips"), get("destination_ips")
        ports, accounts = get("destination_ports"), get("service_accounts")
        self.namespaces = None if namespaces is None else _string_set(namespaces)  # type: ignore[arg-type]
        self.principals = None if principals is None else _string_set(principals)  # type: ignore[arg-type]
        self.source_ips = None if source_ips is None else NetworkSet(source_ips)  # type: ignore[arg-type]
        self.destination_ips = None if destination_ips is None else NetworkSet(destination_ips)  # type: ignore[arg-type]
        self.destination_ports = None if ports is None else frozenset(ports)
        self.service_accounts = None if accounts is None else _accounts(accounts)  # type: ignore[arg-type]


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
    # The rules compiled once, when the policy is made: evaluation never walks a list.
    compiled: tuple[tuple[CompiledClause, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        compiled = tuple(tuple(CompiledClause(clause) for clause in rule) for rule in self.rules)
        object.__setattr__(self, "compiled", compiled)

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
