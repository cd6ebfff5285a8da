"""The reference's local configuration file: YAML to model, and back.

`parse_local_config` reads the reference's format exactly (camelCase keys, string matches as the YAML
tags `!Exact`, `!Prefix`, `!Suffix`, `!Presence`, plus our map form `{Exact: x}`) into the values of
`mesh.model` and `policy.model`. Every error names the file, the key path and the reason. The YAML
itself is read by `localyaml.py` (loaded with PyYAML only when a document is parsed: a process that
only holds the model, a data-plane worker, never loads either); `render.py` writes model values back
in this format.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

from mesh.model import (
    ApplicationTunnel,
    AppTunnelProtocol,
    CidrVip,
    ConversionError,
    Endpoint,
    GatewayAddress,
    HealthPolicy,
    IPAddress,
    IPFamilies,
    LoadBalancer,
    LoadBalancingMode,
    LoadBalancingScope,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    NetworkMode,
    Service,
    TunnelProtocol,
    Visibility,
    WeightedWaypoint,
    Workload,
    WorkloadStatus,
    app_tunnel_port,
    check_service_key,
)
from mesh.yamlvalues import Tagged, WrittenFloat, WrittenInt, plain
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

V = TypeVar("V")
E = TypeVar("E")

DEFAULT_HBONE_PORT = 15008

# Spellings of the reference's serde enums.
PROTOCOLS = {"TCP": TunnelProtocol.NONE, "HBONE": TunnelProtocol.HBONE}
NETWORK_MODES = {"Standard": NetworkMode.STANDARD, "HostNetwork": NetworkMode.HOST_NETWORK}
STATUSES = {"Healthy": WorkloadStatus.HEALTHY, "Unhealthy": WorkloadStatus.UNHEALTHY}
APP_TUNNEL_PROTOCOLS = {"NONE": AppTunnelProtocol.NONE, "PROXY": AppTunnelProtocol.PROXY}
SCOPES = {"Global": Scope.GLOBAL, "Namespace": Scope.NAMESPACE, "WorkloadSelector": Scope.WORKLOAD_SELECTOR}
ACTIONS = {"Allow": Action.ALLOW, "Deny": Action.DENY}
ROUTING_PREFERENCES = {
    "Region": LoadBalancingScope.REGION,
    "Zone": LoadBalancingScope.ZONE,
    "Subzone": LoadBalancingScope.SUBZONE,
    "Node": LoadBalancingScope.NODE,
    "Cluster": LoadBalancingScope.CLUSTER,
    "Network": LoadBalancingScope.NETWORK,
}
LOAD_BALANCING_MODES = {
    "Standard": LoadBalancingMode.UNSPECIFIED_MODE,
    "Strict": LoadBalancingMode.STRICT,
    "Failover": LoadBalancingMode.FAILOVER,
    "Passthrough": LoadBalancingMode.PASSTHROUGH,
}
HEALTH_POLICIES = {"OnlyHealthy": HealthPolicy.ONLY_HEALTHY, "AllowAll": HealthPolicy.ALLOW_ALL}
IP_FAMILIES = {"Dual": IPFamilies.DUAL, "IPv4": IPFamilies.IPV4_ONLY, "IPv6": IPFamilies.IPV6_ONLY}
VISIBILITIES = {"Public": Visibility.PUBLIC, "Namespace": Visibility.NAMESPACE}
STRING_MATCH_KINDS = {kind.value: kind for kind in StringMatchKind}

TOP_LEVEL_KEYS = ("workloads", "services", "policies")


class LocalConfigError(ValueError):
    """An unreadable or invalid local config; the message names the file, the key path and the reason."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class LocalConfig:
    workloads: tuple[Workload, ...] = ()
    services: tuple[Service, ...] = ()
    policies: tuple[Authorization, ...] = ()
    # The document as read, JSON-serialisable: `/config_dump` echoes it as `staticConfig`.
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def load_local_config(path: str | os.PathLike[str]) -> LocalConfig:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise LocalConfigError(f"{os.fspath(path)}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise LocalConfigError(f"{os.fspath(path)}: not UTF-8 text") from None
    return parse_local_config(text, os.fspath(path))


def parse_local_config(text: str, source: str = "<inline>", *, raw: bool = True) -> LocalConfig:
    """`raw=False`: no `raw` document kept (the control plane's use), and a plain-shaped file read entry
    by entry (`yamlstream`), each converted as it is read: several times faster and smaller."""
    import yaml

    from mesh import localyaml, yamlstream

    if not raw:
        try:
            return _streamed(text)
        except (yamlstream.Unsupported, _Invalid):
            pass  # read again whole below: its errors name the line, the key path and the reason
    try:
        document = localyaml.load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise LocalConfigError(f"{source}: {where}invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise LocalConfigError(f"{source}: invalid YAML: {e}") from None
    except (ValueError, TypeError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        # A PyYAML constructor that fails in its own way (`StrictLoader.construct_object` names most).
        raise LocalConfigError(f"{source}: invalid YAML: cannot read a value: {e}") from None
    try:
        return _local_config(document)
    except _Invalid as e:
        prefix = f"{source}: {e.path}: " if e.path else f"{source}: "
        raise LocalConfigError(prefix + e.reason) from None


# --- reading the document ---------------------------------------------------------------------


class _Invalid(Exception):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def _fail(path: str, reason: str) -> NoReturn:
    raise _Invalid(path, reason)


def describe_value(value: object) -> str:
    """A YAML value as an error message names it (\"the string 'x'\", \"a list\", ...)."""
    if value is None:
        return "null"
    if isinstance(value, Tagged):
        return f"a value tagged !{value.tag}"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


class _Object:
    """A mapping read as an object: remembers the keys asked for, so that the others can be refused."""

    def __init__(self, value: object, path: str) -> None:
        if not isinstance(value, dict):
            _fail(path, f"expected a mapping, got {describe_value(value)}")
        self._items: dict[Any, Any] = value
        self._path = path
        self._known: list[str] = []

    def at(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def need(self, key: str, convert: Callable[[object, str], V]) -> V:
        self._known.append(key)
        if key not in self._items:
            _fail(self.at(key), "missing required key")
        return convert(self._items[key], self.at(key))

    def get(self, key: str, convert: Callable[[object, str], V], default: V) -> V:
        """An optional key; null counts as left out."""
        self._known.append(key)
        value = self._items.get(key)
        return default if value is None else convert(value, self.at(key))

    def refuse_unknown(self) -> None:
        for key in self._items:
            if key not in self._known:
                _fail(self.at(str(key)), f"unknown key (expected one of: {', '.join(self._known)})")


def _string(value: object, path: str) -> str:
    # The reference's parser reads any plain scalar as the text written (`canonicalRevision: 1.10`).
    if isinstance(value, str):
        return value
    if isinstance(value, WrittenInt | WrittenFloat):
        return value.text
    if isinstance(value, bool):
        return str(value).lower()
    _fail(path, f"expected a string, got {describe_value(value)}")


def _name(value: object, path: str) -> str:
    """A string that names something (a service's name, namespace or hostname, a policy's name):
    the proxies refuse a resource where it is empty."""
    text = _string(value, path)
    if not text:
        _fail(path, "empty (the proxies refuse a resource without it)")
    return text


def _gateway_port(value: object, path: str) -> int:
    port = _port(value, path)
    if port == 0:
        _fail(path, "port 0: the gateway could never be reached")
    return port


def _bool(value: object, path: str) -> bool:
    if isinstance(value, bool):
        return value
    _fail(path, f"expected true or false, got {describe_value(value)}")


def _unsigned(value: object, path: str, bits: int, what: str) -> int:
    # Map keys arrive as strings from JSON-shaped YAML (and from our own dump), so digits are accepted.
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(path, f"expected {what}, got {describe_value(value)}")
    if not 0 <= value < 1 << bits:
        _fail(path, f"invalid {what} {value} (expected 0..{(1 << bits) - 1})")
    return int(value)  # not the WrittenInt that remembers its text


def _port(value: object, path: str) -> int:
    return _unsigned(value, path, 16, "port")


def _u32(value: object, path: str) -> int:
    return _unsigned(value, path, 32, "unsigned 32-bit integer")


def _ip(value: object, path: str) -> IPAddress:
    if not isinstance(value, str):
        _fail(path, f"expected an IP address, got {describe_value(value)}")
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        _fail(path, f"invalid IP address {value!r}")


def _cidr(value: object, path: str) -> IPNetwork:
    """`10.0.0.0/8`; host bits are allowed and a bare IP is a /32 or /128."""
    if not isinstance(value, str):
        _fail(path, f"expected a CIDR, got {describe_value(value)}")
    try:
        return ipaddress.ip_network(value, strict=False)
    except ValueError:
        _fail(path, f"invalid CIDR {value!r}")


def _one_of(table: Mapping[str, E]) -> Callable[[object, str], E]:
    def read(value: object, path: str) -> E:
        if isinstance(value, str) and value in table:
            return table[value]
        _fail(path, f"invalid value {describe_value(value)} (expected one of: {', '.join(table)})")

    return read


def _list_of(convert: Callable[[object, str], V]) -> Callable[[object, str], tuple[V, ...]]:
    def read(value: object, path: str) -> tuple[V, ...]:
        if not isinstance(value, list):
            _fail(path, f"expected a list, got {describe_value(value)}")
        return tuple(convert(item, f"{path}[{i}]") for i, item in enumerate(value))

    return read


def _mapping(value: object, path: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        _fail(path, f"expected a mapping, got {describe_value(value)}")
    return value


def _key_path(path: str, key: object) -> str:
    return f"{path}[{json.dumps(key) if isinstance(key, str) else key}]"


def _port_map(value: object, path: str) -> tuple[tuple[int, int], ...]:
    """`{service port: target port}`."""
    return tuple(
        (_port(svc, _key_path(path, svc)), _port(target, _key_path(path, svc)))
        for svc, target in _mapping(value, path).items()
    )


def _namespaced_key(value: object, path: str) -> str:
    try:
        return check_service_key(_string(value, path))
    except ConversionError as e:
        _fail(path, e.reason)


def _network_address(value: object, path: str) -> NetworkAddress:
    """`"<network>/<ip>"`; the network may be empty (`"/10.96.0.10"`)."""
    text = _string(value, path)
    network, slash, ip = text.partition("/")
    if not slash:
        _fail(path, f"invalid address {text!r} (expected '<network>/<ip>')")
    try:
        return NetworkAddress(network, ipaddress.ip_address(ip))
    except ValueError:
        _fail(path, f"invalid address {text!r}: invalid IP address {ip!r}")


def _gateway_destination(value: object, path: str) -> NetworkAddress | NamespacedHostname:
    """Tried as `<network>/<ip>` first, then as `<namespace>/<hostname>`."""
    text = _string(value, path)
    first, slash, rest = text.partition("/")
    if not slash or not rest:
        _fail(path, f"invalid destination {text!r} (expected '<network>/<ip>' or '<namespace>/<hostname>')")
    try:
        return NetworkAddress(first, ipaddress.ip_address(rest))
    except ValueError:
        if not first:
            _fail(path, f"invalid destination {text!r}: a hostname without its namespace")
        return NamespacedHostname(first, rest)


def _gateway(value: object, path: str, strict: bool = True) -> GatewayAddress:
    obj = _Object(value, path)
    gateway = GatewayAddress(
        destination=obj.need("destination", _gateway_destination),
        hbone_mtls_port=obj.get("hboneMtlsPort", _gateway_port, DEFAULT_HBONE_PORT),
    )
    if strict:
        obj.refuse_unknown()
    return gateway


def _application_tunnel(value: object, path: str) -> ApplicationTunnel:
    obj = _Object(value, path)
    port = obj.get("port", _port, 0)
    return ApplicationTunnel(
        protocol=obj.get("protocol", _one_of(APP_TUNNEL_PROTOCOLS), AppTunnelProtocol.NONE),
        port=app_tunnel_port(port),
    )


def _locality(value: object, path: str) -> Locality:
    obj = _Object(value, path)
    return Locality(
        region=obj.get("region", _string, ""),
        zone=obj.get("zone", _string, ""),
        subzone=obj.get("subzone", _string, ""),
    )


def _memberships(value: object, path: str) -> tuple[tuple[str, tuple[tuple[int, int], ...]], ...]:
    """A workload's `services`: `{"<namespace>/<hostname>": {service port: target port}}`."""
    return tuple(
        (_namespaced_key(key, _key_path(path, key)), _port_map(ports, _key_path(path, key)))
        for key, ports in _mapping(value, path).items()
    )


def _workload(value: object, path: str) -> Workload:
    # Unknown keys in a workload entry, nested ones included, are ignored, as by the reference; and no
    # xDS defaults apply (an empty trust domain stays empty).
    obj = _Object(value, path)
    lenient_gateway = functools.partial(_gateway, strict=False)
    return Workload(
        uid=obj.get("uid", _string, ""),
        name=obj.get("name", _string, ""),
        namespace=obj.need("namespace", _string),
        addresses=obj.need("workloadIps", _list_of(_ip)),
        hostname=obj.get("hostname", _string, ""),
        network=obj.get("network", _string, ""),
        tunnel_protocol=obj.get("protocol", _one_of(PROTOCOLS), TunnelProtocol.NONE),
        trust_domain=obj.get("trustDomain", _string, ""),
        service_account=obj.get("serviceAccount", _string, ""),
        waypoint=obj.get("waypoint", lenient_gateway, None),
        network_gateway=obj.get("networkGateway", lenient_gateway, None),
        node=obj.get("node", _string, ""),
        canonical_name=obj.get("canonicalName", _string, ""),
        canonical_revision=obj.get("canonicalRevision", _string, ""),
        workload_type=obj.get("workloadType", _string, ""),
        workload_name=obj.get("workloadName", _string, ""),
        native_tunnel=obj.get("nativeTunnel", _bool, False),
        application_tunnel=obj.get("applicationTunnel", _application_tunnel, None),
        services=obj.get("services", _memberships, ()),
        authorization_policies=obj.get("authorizationPolicies", _list_of(_string), ()),
        status=obj.get("status", _one_of(STATUSES), WorkloadStatus.HEALTHY),
        cluster_id=obj.get("clusterId", _string, ""),
        locality=obj.get("locality", _locality, Locality()),
        network_mode=obj.get("networkMode", _one_of(NETWORK_MODES), NetworkMode.STANDARD),
        capacity=obj.get("capacity", _u32, 1),
    )


def _cidr_vip(value: object, path: str) -> CidrVip:
    obj = _Object(value, path)
    vip = CidrVip(network=obj.get("network", _string, ""), cidr=obj.need("cidr", _cidr))
    obj.refuse_unknown()
    return vip


def _endpoints(value: object, path: str) -> tuple[Endpoint, ...]:
    """A service's `endpoints`: `{uid: {workloadUid, port, status}}`."""
    endpoints = []
    for uid, entry in _mapping(value, path).items():
        obj = _Object(entry, _key_path(path, uid))
        endpoints.append(
            Endpoint(
                workload_uid=obj.get("workloadUid", _string, _string(uid, _key_path(path, uid))),
                port=obj.get("port", _port_map, ()),
                status=obj.get("status", _one_of(STATUSES), WorkloadStatus.HEALTHY),
            )
        )
        obj.refuse_unknown()
    return tuple(endpoints)


def _weighted_waypoint(value: object, path: str) -> WeightedWaypoint:
    obj = _Object(value, path)
    waypoint = WeightedWaypoint(
        destination=obj.need("destination", _gateway), weight=obj.get("weight", _u32, 1)
    )
    obj.refuse_unknown()
    return waypoint


def _load_balancer(value: object, path: str) -> LoadBalancer:
    obj = _Object(value, path)
    balancer = LoadBalancer(
        routing_preferences=obj.get("routingPreferences", _list_of(_one_of(ROUTING_PREFERENCES)), ()),
        mode=obj.get("mode", _one_of(LOAD_BALANCING_MODES), LoadBalancingMode.UNSPECIFIED_MODE),
        health_policy=obj.get("healthPolicy", _one_of(HEALTH_POLICIES), HealthPolicy.ONLY_HEALTHY),
    )
    obj.refuse_unknown()
    return balancer


def _service(value: object, path: str) -> Service:
    obj = _Object(value, path)
    service = Service(
        name=obj.need("name", _name),
        namespace=obj.need("namespace", _name),
        hostname=obj.need("hostname", _name),
        vips=obj.need("vips", _list_of(_network_address)),
        ports=obj.need("ports", _port_map),
        cidr_vips=obj.get("cidrVips", _list_of(_cidr_vip), ()),
        endpoints=obj.get("endpoints", _endpoints, ()),
        subject_alt_names=obj.get("subjectAltNames", _list_of(_string), ()),
        waypoint=obj.get("waypoint", _gateway, None),
        weighted_waypoints=obj.get("weightedWaypoints", _list_of(_weighted_waypoint), ()),
        load_balancer=obj.get("loadBalancer", _load_balancer, None),
        ip_families=obj.get("ipFamilies", _one_of(IP_FAMILIES), IPFamilies.AUTOMATIC),
        canonical=obj.get("canonical", _bool, False),
        visibility=obj.get("visibility", _one_of(VISIBILITIES), Visibility.PUBLIC),
    )
    obj.refuse_unknown()
    return service


_STRING_MATCH_FORMS = "!Exact, !Prefix, !Suffix or !Presence"


def _string_match(value: object, path: str) -> StringMatch:
    """`!Exact "x"` (the reference's form) or `{Exact: "x"}` (ours)."""
    if isinstance(value, Tagged):
        kind = STRING_MATCH_KINDS.get(value.tag)
        if kind is None:
            _fail(path, f"unknown string match tag '!{value.tag}' (expected {_STRING_MATCH_FORMS})")
        inner = value.value
    elif isinstance(value, dict) and len(value) == 1:
        ((name, inner),) = value.items()
        kind = STRING_MATCH_KINDS.get(name)
        if kind is None:
            _fail(path, f"unknown string match kind {describe_value(name)} (expected {_STRING_MATCH_FORMS})")
    else:
        _fail(path, f"expected a string match ({_STRING_MATCH_FORMS}), got {describe_value(value)}")
    if kind is StringMatchKind.PRESENCE:
        # Tagged scalars are not resolved, so `!Presence null` arrives as the text "null".
        if inner not in (None, [], {}, "", "~", "null"):
            _fail(path, f"!Presence takes no value ([] or null), got {describe_value(inner)}")
        return StringMatch(kind)
    return StringMatch(kind, _string(inner, path))


def _service_account_match(value: object, path: str) -> ServiceAccountMatch:
    obj = _Object(value, path)
    match = ServiceAccountMatch(
        namespace=obj.need("namespace", _string), service_account=obj.need("serviceAccount", _string)
    )
    obj.refuse_unknown()
    return match


def _match(value: object, path: str) -> Match:
    obj = _Object(value, path)
    string_matches = _list_of(_string_match)
    service_accounts = _list_of(_service_account_match)
    cidrs = _list_of(_cidr)
    ports = _list_of(_port)
    match = Match(
        namespaces=obj.get("namespaces", string_matches, ()),
        not_namespaces=obj.get("notNamespaces", string_matches, ()),
        principals=obj.get("principals", string_matches, ()),
        not_principals=obj.get("notPrincipals", string_matches, ()),
        source_ips=obj.get("sourceIps", cidrs, ()),
        not_source_ips=obj.get("notSourceIps", cidrs, ()),
        destination_ips=obj.get("destinationIps", cidrs, ()),
        not_destination_ips=obj.get("notDestinationIps", cidrs, ()),
        destination_ports=obj.get("destinationPorts", ports, ()),
        not_destination_ports=obj.get("notDestinationPorts", ports, ()),
        service_accounts=obj.get("serviceAccounts", service_accounts, ()),
        not_service_accounts=obj.get("notServiceAccounts", service_accounts, ()),
    )
    obj.refuse_unknown()
    return match


def _policy(value: object, path: str) -> Authorization:
    obj = _Object(value, path)
    policy = Authorization(
        name=obj.need("name", _name),
        namespace=obj.need("namespace", _string),
        scope=obj.need("scope", _one_of(SCOPES)),
        action=obj.need("action", _one_of(ACTIONS)),
        # rules (OR) of clauses (AND) of matches (OR)
        rules=obj.need("rules", _list_of(_list_of(_list_of(_match)))),
        dry_run=obj.need("dryRun", _bool),
    )
    obj.refuse_unknown()
    return policy


def _streamed(text: str) -> LocalConfig:
    from mesh import yamlstream

    readers: dict[str, Callable[[object, str], Any]] = {
        "workloads": _workload,
        "services": _service,
        "policies": _policy,
    }
    converted: dict[str, list[Any]] = {key: [] for key in TOP_LEVEL_KEYS}
    for key, entry in yamlstream.items(text, TOP_LEVEL_KEYS):
        done = converted[key]
        done.append(readers[key](entry, f"{key}[{len(done)}]"))
    return LocalConfig(
        workloads=tuple(converted["workloads"]),
        services=tuple(converted["services"]),
        policies=tuple(converted["policies"]),
    )


def _local_config(document: object) -> LocalConfig:
    if document is None:  # an empty file
        return LocalConfig()
    if not isinstance(document, dict):
        _fail("", f"expected a mapping with keys {', '.join(TOP_LEVEL_KEYS)}, got {describe_value(document)}")
    obj = _Object(document, "")
    config = LocalConfig(
        workloads=obj.get("workloads", _list_of(_workload), ()),
        services=obj.get("services", _list_of(_service), ()),
        policies=obj.get("policies", _list_of(_policy), ()),
        raw=plain(document),
    )
    obj.refuse_unknown()
    return config
