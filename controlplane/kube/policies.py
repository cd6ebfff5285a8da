"""AuthorizationPolicies and PeerAuthentications to the L4 policies ztunnel enforces, as istiod converts them.

AuthorizationPolicy: one `Authorization` named as the policy. Scope: `WORKLOAD_SELECTOR` with a
`selector`, else `GLOBAL` in the root namespace, else `NAMESPACE`. ALLOW and DENY only (AUDIT and
CUSTOM are not for ztunnel); a policy with `targetRef(s)` is for a waypoint or gateway, not sent. Each
rule is a group of clauses: the `to` operations (ports, notPorts) OR-ed, the `from` sources
(principals, namespaces, serviceAccounts, ipBlocks and their `not`s) OR-ed, then one clause per `when`
on `source.ip`, `source.namespace`, `source.principal`, `destination.ip`, `destination.port`.
Principals are sent as written: no trust-domain alias is added and `cluster.local` stands for no other
trust domain. A source's `trustDomains`/`notTrustDomains` are not sent (a warning says what that does).
HTTP attributes (hosts, methods, paths, remoteIpBlocks, requestPrincipals, other `when` keys) are
left out of the match; in an ALLOW policy the rule holding them is dropped (it can never match), in a
DENY policy the rule is kept without them, so it denies more than asked, or, when nothing is left of
a match, nothing at all. The `istio.io/dry-run` annotation makes istiod hold a policy back (ztunnel
dry-run support is off by default).

PeerAuthentication: `STRICT` (mesh, namespace or workload level, the oldest of each winning) makes a
workload reference the static policy `<root>/istio_converted_static_strict`, a DENY of any connection
without a peer identity, sent whenever any PeerAuthentication exists. A workload-selecting policy with
port-level modes becomes `converted_peer_authentication_<name>`, its exceptions by port.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from controlplane.kube.cluster import DRY_RUN_ANNOTATION, items, mapping, string_map, strings
from controlplane.kube.manifests import Obj, refuse
from policy.model import (
    Action,
    Authorization,
    IPNetwork,
    Match,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
)

STATIC_STRICT = "istio_converted_static_strict"
CONVERTED_PEER_AUTHENTICATION = "converted_peer_authentication_"
L4_WHEN_KEYS = ("source.ip", "source.namespace", "source.principal", "destination.ip", "destination.port")

HTTP_RULE = (
    "ztunnel does not support HTTP attributes (found: {}). "
    "In ambient mode you must use a waypoint proxy to enforce HTTP rules. {}"
)
DENY_NO_EFFECT = (
    "After omitting unsupported HTTP attributes, this DENY policy has no enforceable rules at ztunnel "
    "and will have no effect. Deploy a waypoint proxy and use a targetRef to enforce this policy."
)
DENY_MIXED = "DENY policy with HTTP attributes is enforced without the HTTP rules. This will be more restrictive than requested."
ALLOW_RULE = "Within an ALLOW policy, rules matching HTTP attributes are omitted. This will be more restrictive than requested."
TRUST_DOMAINS = (
    "ztunnel does not enforce {} (istiod leaves them out of the policy it sends): a source with "
    "nothing else matches no connection, and one with other fields matches them from any trust domain"
)

T = TypeVar("T")
_NOT_MATCH = StringMatch(StringMatchKind.PRESENCE)
NOT_AUTHENTICATED = Match(not_principals=(_NOT_MATCH,))


@dataclass(frozen=True)
class Converted:
    """A policy for ztunnel (or None: not for ztunnel), its selector, and what to tell the user."""

    policy: Authorization | None
    selector: Mapping[str, str] | None = None  # None: no selector
    warning: str = ""


def string_matches(values: Sequence[str]) -> tuple[StringMatch, ...]:
    out = []
    for v in values:
        if v == "*":
            out.append(StringMatch(StringMatchKind.PRESENCE))
        elif v.startswith("*"):
            out.append(StringMatch(StringMatchKind.SUFFIX, v[1:]))
        elif v.endswith("*"):
            out.append(StringMatch(StringMatchKind.PREFIX, v[:-1]))
        else:
            out.append(StringMatch(StringMatchKind.EXACT, v))
    return tuple(out)


def ports(values: Sequence[str]) -> tuple[int, ...]:
    """istiod drops what is no port number."""
    return tuple(int(v) for v in values if v.isascii() and v.isdigit() and int(v) <= 65535)


def networks(values: Sequence[str]) -> tuple[IPNetwork, ...]:
    """istiod drops what is no IP or CIDR; a bare IP is a full-length prefix."""
    out = []
    for v in values:
        try:
            out.append(ipaddress.ip_network(v, strict=False))
        except ValueError:
            continue
    return tuple(out)


def service_accounts(values: Sequence[str], namespace: str) -> tuple[ServiceAccountMatch, ...]:
    out = []
    for v in values:
        ns, slash, sa = v.partition("/")
        out.append(ServiceAccountMatch(ns, sa) if slash else ServiceAccountMatch(namespace, v))
    return tuple(out)


def _present(spec: Mapping[str, Any], names: Sequence[str]) -> list[str]:
    return [n for n in names if spec.get(n)]


def _when(
    key: str,
    condition: Mapping[str, Any],
    wanted: str,
    convert: Callable[[list[str]], tuple[T, ...]],
    negate: bool,
) -> tuple[T, ...]:
    if key != wanted:
        return ()
    return convert(strings(condition.get("notValues" if negate else "values"), "when.values"))


def _rule(
    action: Action, rule: Mapping[str, Any], namespace: str
) -> tuple[tuple[tuple[Match, ...], ...] | None, list[str]]:
    http: list[str] = []
    to: list[Match] = []
    for i, entry in enumerate(items(rule.get("to"), "to")):
        op = mapping(mapping(entry, f"to[{i}]").get("operation"), f"to[{i}].operation")
        http += _present(op, ("hosts", "notHosts", "methods", "notMethods", "paths", "notPaths"))
        to.append(
            Match(
                destination_ports=ports(strings(op.get("ports"), "ports")),
                not_destination_ports=ports(strings(op.get("notPorts"), "notPorts")),
            )
        )
    sources: list[Match] = []
    for i, entry in enumerate(items(rule.get("from"), "from")):
        src = mapping(mapping(entry, f"from[{i}]").get("source"), f"from[{i}].source")
        http += _present(
            src, ("remoteIpBlocks", "notRemoteIpBlocks", "requestPrincipals", "notRequestPrincipals")
        )

        def get(name: str, src: Mapping[str, Any] = src) -> list[str]:
            return strings(src.get(name), name)

        sources.append(
            Match(
                source_ips=networks(get("ipBlocks")),
                not_source_ips=networks(get("notIpBlocks")),
                namespaces=string_matches(get("namespaces")),
                not_namespaces=string_matches(get("notNamespaces")),
                service_accounts=service_accounts(get("serviceAccounts"), namespace),
                not_service_accounts=service_accounts(get("notServiceAccounts"), namespace),
                principals=string_matches(get("principals")),
                not_principals=string_matches(get("notPrincipals")),
            )
        )
    clauses: list[tuple[Match, ...]] = []
    if to:
        clauses.append(tuple(to))
    if sources:
        clauses.append(tuple(sources))
    for i, raw in enumerate(items(rule.get("when"), "when")):
        condition = mapping(raw, f"when[{i}]")
        key = str(condition.get("key", ""))
        if key not in L4_WHEN_KEYS:
            http.append(key)
        match = Match(
            namespaces=_when(key, condition, "source.namespace", string_matches, False),
            principals=_when(key, condition, "source.principal", string_matches, False),
            source_ips=_when(key, condition, "source.ip", networks, False),
            destination_ports=_when(key, condition, "destination.port", ports, False),
            destination_ips=_when(key, condition, "destination.ip", networks, False),
            not_namespaces=_when(key, condition, "source.namespace", string_matches, True),
            not_principals=_when(key, condition, "source.principal", string_matches, True),
            not_source_ips=_when(key, condition, "source.ip", networks, True),
            not_destination_ports=_when(key, condition, "destination.port", ports, True),
            not_destination_ips=_when(key, condition, "destination.ip", networks, True),
        )
        clauses.append((match,))
    if action is Action.ALLOW and http:
        return None, http
    return tuple(clauses), http


def _trust_domain_fields(rules: list[Any]) -> list[str]:
    """`trustDomains`/`notTrustDomains` of the policy's sources, which istiod's ambient conversion
    does not read (its sidecars and waypoints enforce them)."""
    found: set[str] = set()
    for rule in rules:
        for entry in (rule.get("from") or []) if isinstance(rule, dict) else []:
            source = entry.get("source") if isinstance(entry, dict) else None
            if isinstance(source, dict):
                found.update(n for n in ("trustDomains", "notTrustDomains") if source.get(n))
    return sorted(found)


def _effective(rules: Sequence[tuple[tuple[Match, ...], ...]]) -> bool:
    """Whether some group can match at ztunnel, which skips empty matches."""
    return any(all(any(m != Match() for m in clause) for clause in rule) for rule in rules)


def authorization_policy(obj: Obj, root_namespace: str) -> Converted:
    spec = obj.spec
    if spec.get("targetRef") or spec.get("targetRefs"):
        return Converted(None)  # for a waypoint or gateway, not for ztunnel
    if obj.annotations.get(DRY_RUN_ANNOTATION, "").lower() in ("true", "1", "t"):
        return Converted(
            None,
            warning="uses the dry-run annotation; istiod does not send dry-run policies to ztunnel by default",
        )
    raw_selector = spec.get("selector")
    selector = (
        string_map(mapping(raw_selector, "spec.selector").get("matchLabels"), "matchLabels")
        if raw_selector is not None
        else None
    )
    scope = Scope.WORKLOAD_SELECTOR
    if selector is None:
        scope = Scope.GLOBAL if obj.namespace == root_namespace else Scope.NAMESPACE
    action_name = spec.get("action", "ALLOW")
    if action_name not in ("ALLOW", "DENY"):
        if action_name in ("AUDIT", "CUSTOM"):
            return Converted(None, warning=f"ztunnel does not support the {action_name} action")
        refuse(f"spec.action: unknown action {action_name!r} (expected ALLOW, DENY, AUDIT or CUSTOM)")
    action = Action.ALLOW if action_name == "ALLOW" else Action.DENY
    rules = []
    http: set[str] = set()
    for i, raw in enumerate(items(spec.get("rules"), "spec.rules")):
        rule, found = _rule(action, mapping(raw, f"spec.rules[{i}]"), obj.namespace)
        http.update(found)
        if rule is not None:
            rules.append(rule)
    policy = Authorization(obj.name, obj.namespace, scope, action, tuple(rules))
    warnings = []
    if http:
        tail = (DENY_MIXED if _effective(rules) else DENY_NO_EFFECT) if action is Action.DENY else ALLOW_RULE
        warnings.append(HTTP_RULE.format(", ".join(sorted(http)), tail))
    trust_domains = _trust_domain_fields(items(spec.get("rules"), "spec.rules"))
    if trust_domains:
        warnings.append(TRUST_DOMAINS.format(" and ".join(trust_domains)))
    return Converted(policy, selector, "; ".join(warnings))


# --- PeerAuthentication -------------------------------------------------------------------------


def mtls_mode(value: object) -> str:
    mode = mapping(value, "mtls").get("mode") if value is not None else None
    return str(mode) if mode else "UNSET"


def port_modes(obj: Obj) -> list[tuple[int, str]]:
    out = []
    for port, value in mapping(obj.spec.get("portLevelMtls"), "spec.portLevelMtls").items():
        if not str(port).isdigit() or not 0 < int(port) <= 65535:
            refuse(f"spec.portLevelMtls: invalid port {port!r}")
        out.append((int(port), mtls_mode(value)))
    return sorted(out)


def _selector(obj: Obj) -> dict[str, str]:
    return string_map(mapping(obj.spec.get("selector"), "spec.selector").get("matchLabels"), "matchLabels")


def oldest(policies: Sequence[Obj]) -> Obj | None:
    return min(policies, key=lambda p: p.created) if policies else None


def static_strict(root_namespace: str) -> Authorization:
    return Authorization(
        STATIC_STRICT, root_namespace, Scope.WORKLOAD_SELECTOR, Action.DENY, (((NOT_AUTHENTICATED,),),)
    )


def converted_name(obj: Obj) -> str:
    return CONVERTED_PEER_AUTHENTICATION + obj.name


def _port_rules(pa: Obj, ns_pol: Obj | None, root_pol: Obj | None) -> tuple[list[Any], list[Match], bool]:
    mode = mtls_mode(pa.spec.get("mtls"))
    ns_mode = mtls_mode(ns_pol.spec.get("mtls")) if ns_pol is not None else None
    root_mode = mtls_mode(root_pol.spec.get("mtls")) if root_pol is not None else None
    groups: list[Any] = []
    rules: list[Match] = []
    non_strict = False
    for port, port_mode in port_modes(pa):
        if port_mode == "STRICT":
            inherited = mode == "STRICT" or (
                mode == "UNSET"
                and (ns_mode == "STRICT" or (ns_mode in (None, "UNSET") and root_mode == "STRICT"))
            )
            if not inherited:
                groups.append(((Match(not_principals=(_NOT_MATCH,), destination_ports=(port,)),),))
        elif port_mode in ("PERMISSIVE", "DISABLE"):
            if mode in ("PERMISSIVE", "DISABLE"):
                continue
            if mode == "UNSET" and (
                (ns_mode is not None and ns_mode != "STRICT")
                or (ns_mode is None and root_mode is not None and root_mode != "STRICT")
                or (ns_mode is None and root_mode is None)
            ):
                continue
            non_strict = True
            rules.append(Match(not_destination_ports=(port,)))
    return groups, rules, non_strict


def peer_authentication(
    pa: Obj, root_namespace: str, ns_pol: Obj | None, root_pol: Obj | None
) -> Authorization | None:
    """The converted form of a workload policy with port-level modes (None for the others)."""
    if pa.namespace == root_namespace or pa.spec.get("selector") is None or not pa.spec.get("portLevelMtls"):
        return None
    mode = mtls_mode(pa.spec.get("mtls"))
    clause: list[Match] = [NOT_AUTHENTICATED] if mode == "STRICT" else []
    groups, port_rules, non_strict = _port_rules(pa, ns_pol, root_pol)
    clause += port_rules
    if mode == "STRICT" and not non_strict:
        return None
    if not clause and not groups:
        return None
    ns_mode = mtls_mode(ns_pol.spec.get("mtls")) if ns_pol is not None else None
    root_strict = root_pol is not None and mtls_mode(root_pol.spec.get("mtls")) == "STRICT"
    merge = (root_strict and ns_mode in (None, "UNSET", "STRICT")) or ns_mode == "STRICT"
    if merge and non_strict:
        clause.append(NOT_AUTHENTICATED)
    if clause:
        # Each match its own clause (istiod's Rules): all of them must hold for the DENY.
        groups.append(tuple((m,) for m in clause))
    return Authorization(
        converted_name(pa), pa.namespace, Scope.WORKLOAD_SELECTOR, Action.DENY, tuple(groups)
    )


def workload_peer_keys(applicable: Sequence[Obj], root_namespace: str) -> list[str]:
    """The PeerAuthentication-derived policy keys a workload references (istiod's effective mode)."""
    mesh = oldest([p for p in applicable if not _selector(p) and p.namespace == root_namespace])
    namespace = oldest([p for p in applicable if not _selector(p) and p.namespace != root_namespace])
    workload = oldest([p for p in applicable if _selector(p) and p.namespace != root_namespace])
    strict = mesh is not None and mtls_mode(mesh.spec.get("mtls")) == "STRICT"
    if namespace is not None and mtls_mode(namespace.spec.get("mtls")) != "UNSET":
        strict = mtls_mode(namespace.spec.get("mtls")) == "STRICT"
    port_key = ""
    if workload is not None:
        mode = mtls_mode(workload.spec.get("mtls"))
        if mode == "STRICT":
            strict = True
        if mode in ("PERMISSIVE", "DISABLE"):
            strict = False
        modes = [m for _, m in port_modes(workload)]
        key = f"{workload.namespace}/{converted_name(workload)}"
        if modes:
            if mode == "STRICT":
                if any(m in ("PERMISSIVE", "DISABLE") for m in modes):
                    port_key, strict = key, False
            elif mode in ("PERMISSIVE", "DISABLE"):
                if "STRICT" in modes:
                    port_key = key
            elif strict:
                if "PERMISSIVE" in modes:
                    port_key, strict = key, False
            else:
                if "STRICT" in modes:
                    port_key = key
    keys = set()
    if strict:
        keys.add(f"{root_namespace}/{STATIC_STRICT}")
    if port_key:
        keys.add(port_key)
    return sorted(keys)
