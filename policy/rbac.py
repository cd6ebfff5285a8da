"""L4 authorization decisions: whether a policy matches a connection, and the verdict.

Pure functions over `policy.model` values. The caller picks the candidate policies of the destination
workload, enforces the `Decision` and logs the dry-run notes it carries.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from policy.model import (
    MATCH_FIELDS,
    Action,
    Authorization,
    CompiledClause,
    Connection,
    Match,
    StringMatch,
    StringMatchKind,
    compiled_match,
)

# The reference's wording: users grep access logs for these.
NOT_ALLOWED = "allow policies exist, but none allowed"
EXPLICITLY_DENIED = "explicitly denied by: "
DRY_RUN_DENY_MATCH = "dry-run: deny policy match"
DRY_RUN_ALLOW_MATCH = "dry-run: allow policy match"
DRY_RUN_NO_ALLOW_MATCH = "dry-run: no allow policies match"

SPIFFE_PREFIX = "spiffe://"


@dataclass(frozen=True, slots=True)
class Allow:
    """The connection may proceed. `notes` are the dry-run log lines of the evaluation."""

    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Deny:
    """The connection is refused: `reason` is the reference's message, `policy` the denying policy key
    (None when no ALLOW policy matched)."""

    reason: str
    policy: str | None = None
    notes: tuple[str, ...] = ()


Decision = Allow | Deny


def authorize(policies: Iterable[Authorization], conn: Connection) -> Decision:
    """The verdict of the candidate policies on one connection, in the reference's order."""
    allows: list[Authorization] = []
    dry_run_allows: list[Authorization] = []
    denies: list[Authorization] = []
    dry_run_denies: list[Authorization] = []
    for policy in policies:
        if policy.action is Action.DENY:
            (dry_run_denies if policy.dry_run else denies).append(policy)
        else:
            (dry_run_allows if policy.dry_run else allows).append(policy)

    notes: list[str] = [
        f"{DRY_RUN_DENY_MATCH} policy={policy.key}" for policy in dry_run_denies if matches(policy, conn)
    ]
    for policy in denies:
        if matches(policy, conn):
            return Deny(EXPLICITLY_DENIED + policy.key, policy.key, tuple(notes))

    dry_run_allowed = False
    for policy in dry_run_allows:
        if matches(policy, conn):
            dry_run_allowed = True
            notes.append(f"{DRY_RUN_ALLOW_MATCH} policy={policy.key}")
    if not allows:
        if dry_run_allows and not dry_run_allowed:
            notes.append(DRY_RUN_NO_ALLOW_MATCH)
        return Allow(tuple(notes))
    if any(matches(policy, conn) for policy in allows):
        return Allow(tuple(notes))
    return Deny(NOT_ALLOWED, None, tuple(notes))


def matches(policy: Authorization, conn: Connection) -> bool:
    """A policy matches when any of its rules does (a policy with zero rules never matches); a rule
    when all its clauses do (a rule without clauses matches); a clause when any of its non-empty
    entries does (a clause without entries matches). Evaluated on `Authorization.compiled`."""
    return any(rule_matches(rule, conn) for rule in policy.compiled)


def rule_matches(rule: tuple[CompiledClause, ...], conn: Connection) -> bool:
    """A rule (of `Authorization.compiled`) matches when all its clauses do."""
    return all(clause_matches(clause, conn) for clause in rule)


def clause_matches(clause: CompiledClause, conn: Connection) -> bool:
    if clause.always:
        return True
    if clause.source_ips is not None and conn.src_ip in clause.source_ips:
        return True
    if clause.destination_ips is not None and conn.dst_ip in clause.destination_ips:
        return True
    if clause.destination_ports is not None and conn.dst_port in clause.destination_ports:
        return True
    if clause.principals is not None:
        principal = principal_of(conn)
        if principal is not None and principal in clause.principals:
            return True
    if clause.namespaces is not None and (conn.src_namespace or "") in clause.namespaces:
        return True
    if (
        clause.service_accounts is not None
        and conn.src_namespace is not None
        and conn.src_service_account is not None
        and (conn.src_namespace, conn.src_service_account) in clause.service_accounts
    ):
        return True
    return any(entry_matches(entry, conn) for entry in clause.entries)


def is_empty(entry: Match) -> bool:
    """An entry with every field empty: skipped, it can never make its clause match."""
    return not any(getattr(entry, name) for name in MATCH_FIELDS)


def entry_matches(entry: Match, conn: Connection) -> bool:
    """Every (positive, negative) field pair of the entry passes for the connection: a positive list
    passes when empty or when an element matches, a negative one when no element matches.

    An address of the other IP family is outside every network (`ipaddress` containment). The lists
    are looked up in their precompiled sets (`CompiledMatch`), never walked."""
    c = compiled_match(entry)
    if entry.destination_ips and conn.dst_ip not in c.destination_ips:
        return False
    if entry.not_destination_ips and conn.dst_ip in c.not_destination_ips:
        return False
    if entry.source_ips and conn.src_ip not in c.source_ips:
        return False
    if entry.not_source_ips and conn.src_ip in c.not_source_ips:
        return False
    if entry.destination_ports and conn.dst_port not in c.destination_ports:
        return False
    if entry.not_destination_ports and conn.dst_port in c.not_destination_ports:
        return False
    if entry.service_accounts or entry.not_service_accounts:
        # Without an identity no service account matches, so only a positive list can fail.
        sa = (
            None
            if conn.src_namespace is None or conn.src_service_account is None
            else (conn.src_namespace, conn.src_service_account)
        )
        if entry.service_accounts and (sa is None or sa not in c.service_accounts):
            return False
        if entry.not_service_accounts and sa is not None and sa in c.not_service_accounts:
            return False
    if entry.principals or entry.not_principals:
        # Without a SPIFFE identity no principal pattern matches, not even presence.
        principal = principal_of(conn)
        if entry.principals and (principal is None or principal not in c.principals):
            return False
        if entry.not_principals and principal is not None and principal in c.not_principals:
            return False
    namespace = conn.src_namespace or ""
    if entry.namespaces and namespace not in c.namespaces:
        return False
    return not (entry.not_namespaces and namespace in c.not_namespaces)


def principal_of(conn: Connection) -> str | None:
    """The source identity as principals are written (`td/ns/x/sa/y`), or None: without a SPIFFE
    identity no principal pattern matches, not even presence."""
    if conn.src_principal is None or not conn.src_principal.startswith(SPIFFE_PREFIX):
        return None
    return conn.src_principal[len(SPIFFE_PREFIX) :]


def string_matches(pattern: StringMatch, value: str) -> bool:
    """Case-sensitive; presence means non-empty."""
    if pattern.kind is StringMatchKind.EXACT:
        return value == pattern.value
    if pattern.kind is StringMatchKind.PREFIX:
        return value.startswith(pattern.value)
    if pattern.kind is StringMatchKind.SUFFIX:
        return value.endswith(pattern.value)
    return value != ""
