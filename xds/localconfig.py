"""The reference's local configuration file: YAML to model, and back.

`parse_local_config` reads the reference's format exactly (camelCase keys, string matches as the YAML
tags `!Exact`, `!Prefix`, `!Suffix`, `!Presence`, plus our map form `{Exact: x}`) into the values of
`xds.model` and `policy.model`. Every error names the file, the key path and the reason. The
`*_to_dict` functions render model values in the same format; `/config_dump` shows them, and what they
produce parses back to equal values.
"""

from __future__ import annotations

import base64
import datetime
import functools
import ipaddress
import json
import os
import re
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar, cast

import yaml

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
from xds.model import (
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


def parse_local_config(text: str, source: str = "<inline>") -> LocalConfig:
    try:
        _check_shape(text)
        document = yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise LocalConfigError(f"{source}: {where}invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise LocalConfigError(f"{source}: invalid YAML: {e}") from None
    except (ValueError, TypeError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        # A PyYAML constructor that fails in its own way (`_Loader.construct_object` names most).
        raise LocalConfigError(f"{source}: invalid YAML: cannot read a value: {e}") from None
    try:
        return _local_config(document)
    except _Invalid as e:
        prefix = f"{source}: {e.path}: " if e.path else f"{source}: "
        raise LocalConfigError(prefix + e.reason) from None


# --- YAML loading -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Tagged:
    """A value written with a local tag (`!Exact "x"`); only string matches may carry one."""

    tag: str
    value: object


# Bounds checked on the parser's events before anything is built, so that neither PyYAML's recursive
# composer nor our readers meet a document nested deeper than any real configuration (one is about
# ten levels deep), and a few hundred bytes of aliases cannot stand for millions of values.
MAX_DEPTH = 100
MAX_ALIASED_NODES = 100_000


def _shape_error(problem: str, event: yaml.Event) -> yaml.MarkedYAMLError:
    return yaml.MarkedYAMLError(problem=problem, problem_mark=cast(yaml.Mark, event.start_mark))


def _check_shape(text: str) -> None:
    """Refuse, as a marked YAML error, nesting deeper than `MAX_DEPTH`, an alias inside its own
    anchor (a recursive value), and aliases that together expand to more than `MAX_ALIASED_NODES`."""
    sizes: dict[str, int] = {}  # anchor -> the number of nodes its value expands to
    open_anchors: set[str] = set()
    stack: list[tuple[str | None, int]] = []  # open collections: (anchor, node count at the start)
    count = aliased = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.ScalarEvent):
            count += 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.CollectionStartEvent):
            if len(stack) >= MAX_DEPTH:
                raise _shape_error(f"nested deeper than {MAX_DEPTH} levels", event)
            stack.append((event.anchor, count))
            count += 1
            if event.anchor is not None:
                open_anchors.add(event.anchor)
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start = stack.pop()
            if anchor is not None:
                sizes[anchor] = count - start
                open_anchors.discard(anchor)
        elif isinstance(event, yaml.AliasEvent) and event.anchor is not None:
            if event.anchor in open_anchors:
                raise _shape_error(f"recursive alias *{event.anchor} (inside its own anchor)", event)
            size = sizes.get(event.anchor, 1)  # an undefined one is reported by the composer
            count += size
            aliased += size
            if aliased > MAX_ALIASED_NODES:
                raise _shape_error(f"aliases expand to more than {MAX_ALIASED_NODES} values", event)


class _Loader(yaml.SafeLoader):
    """PyYAML speaks YAML 1.1; the reference's parser speaks 1.2 and rejects duplicate keys.

    So `no`/`on` stay strings, `010` is ten, no timestamps appear, and a repeated key is an error.
    """

    yaml_implicit_resolvers: dict[Any, Any] = {}

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        # The scanner keeps a possible simple key per open `[`/`{` and re-walks them all for every
        # token it reads ahead: thousands of open brackets cost seconds before the first event.
        if self.flow_level >= MAX_DEPTH:
            raise yaml.scanner.ScannerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels", self.get_mark()
            )
        super().fetch_flow_collection_start(TokenClass)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:  # a list or mapping, also one inside a tag (`!Exact [1]`)
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    "found unhashable key",
                    key_node.start_mark,
                ) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # PyYAML's constructors for explicit tags fail on bad text with whatever they hit (`!!float ''`
        # an IndexError, `!!timestamp nope` an AttributeError, `!!bool ''` a KeyError): name the value.
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, AttributeError, LookupError, OverflowError):
            what = f"value {node.value!r}" if isinstance(node, yaml.ScalarNode) else "collection"
            raise yaml.constructor.ConstructorError(
                None, None, f"invalid {node.tag} {what}", node.start_mark
            ) from None


class _Int(int):
    """An int that remembers how it was written: a string field takes the text (`canonicalRevision: 010`)."""

    text = ""


class _Float(float):
    text = ""


def _scalar_only(node: yaml.Node) -> yaml.ScalarNode:
    if not isinstance(node, yaml.ScalarNode):  # `!!int []`
        raise yaml.constructor.ConstructorError(None, None, f"{node.tag} needs a scalar", node.start_mark)
    return node


def _construct_int(loader: yaml.SafeLoader, tagged: yaml.Node) -> int:
    node = _scalar_only(tagged)
    text = loader.construct_scalar(node)
    digits = text.replace("_", "").lstrip("+-")
    try:
        magnitude = int(digits, 0) if digits[:2] in ("0o", "0x") else int(digits, 10)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"invalid integer {text!r}", node.start_mark
        ) from None
    number = _Int(-magnitude if text.startswith("-") else magnitude)
    number.text = text
    return number


def _construct_float(loader: yaml.SafeLoader, tagged: yaml.Node) -> float:
    node = _scalar_only(tagged)
    number = _Float(loader.construct_yaml_float(node))
    number.text = loader.construct_scalar(node)
    return number


def _text(value: str, node: yaml.Node) -> str:
    """A string as written: `"\\ud83d\\ude00"` (how JSON, `/config_dump` too, escapes one character
    above U+FFFF) is that one character, as in YAML 1.2; PyYAML reads two lone surrogates, which no
    encoder takes. A lone surrogate is an error."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        pass
    try:
        return value.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeDecodeError:
        raise yaml.constructor.ConstructorError(
            None, None, "string with an unpaired surrogate escape (\\ud800-\\udfff)", node.start_mark
        ) from None


def _construct_str(loader: yaml.SafeLoader, node: yaml.Node) -> str:
    return _text(loader.construct_yaml_str(_scalar_only(node)), node)


def _construct_tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> _Tagged:
    value: object
    if isinstance(node, yaml.ScalarNode):
        value = _text(loader.construct_scalar(node), node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        assert isinstance(node, yaml.MappingNode)
        value = loader.construct_mapping(node, deep=True)
    return _Tagged(suffix, value)


# The YAML 1.2 core schema; the int resolver comes before the float one so that `80` is an int.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]
)
_Loader.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"])
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)
_Loader.add_constructor("tag:yaml.org,2002:str", _construct_str)
_Loader.add_multi_constructor("!", _construct_tagged)


def _plain(value: object) -> Any:
    """The document as JSON values: tags become the map form, other YAML-only types strings."""
    if isinstance(value, _Tagged):
        inner = [] if value.tag == StringMatchKind.PRESENCE.value else _plain(value.value)
        return {value.tag: inner}
    if isinstance(value, dict):
        return {
            k if isinstance(k, str | int | float | bool) or k is None else str(k): _plain(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, _Int):
        return int(value)
    if isinstance(value, _Float):
        return float(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


# --- reading the document ---------------------------------------------------------------------


class _Invalid(Exception):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def _fail(path: str, reason: str) -> NoReturn:
    raise _Invalid(path, reason)


def _describe(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, _Tagged):
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
            _fail(path, f"expected a mapping, got {_describe(value)}")
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
    if isinstance(value, _Int | _Float):
        return value.text
    if isinstance(value, bool):
        return str(value).lower()
    _fail(path, f"expected a string, got {_describe(value)}")


def _bool(value: object, path: str) -> bool:
    if isinstance(value, bool):
        return value
    _fail(path, f"expected true or false, got {_describe(value)}")


def _unsigned(value: object, path: str, bits: int, what: str) -> int:
    # Map keys arrive as strings from JSON-shaped YAML (and from our own dump), so digits are accepted.
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(path, f"expected {what}, got {_describe(value)}")
    if not 0 <= value < 1 << bits:
        _fail(path, f"invalid {what} {value} (expected 0..{(1 << bits) - 1})")
    return int(value)  # not the _Int that remembers its text


def _port(value: object, path: str) -> int:
    return _unsigned(value, path, 16, "port")


def _u32(value: object, path: str) -> int:
    return _unsigned(value, path, 32, "unsigned 32-bit integer")


def _ip(value: object, path: str) -> IPAddress:
    if not isinstance(value, str):
        _fail(path, f"expected an IP address, got {_describe(value)}")
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        _fail(path, f"invalid IP address {value!r}")


def _cidr(value: object, path: str) -> IPNetwork:
    """`10.0.0.0/8`; host bits are allowed and a bare IP is a /32 or /128."""
    if not isinstance(value, str):
        _fail(path, f"expected a CIDR, got {_describe(value)}")
    try:
        return ipaddress.ip_network(value, strict=False)
    except ValueError:
        _fail(path, f"invalid CIDR {value!r}")


def _one_of(table: Mapping[str, E]) -> Callable[[object, str], E]:
    def read(value: object, path: str) -> E:
        if isinstance(value, str) and value in table:
            return table[value]
        _fail(path, f"invalid value {_describe(value)} (expected one of: {', '.join(table)})")

    return read


def _list_of(convert: Callable[[object, str], V]) -> Callable[[object, str], tuple[V, ...]]:
    def read(value: object, path: str) -> tuple[V, ...]:
        if not isinstance(value, list):
            _fail(path, f"expected a list, got {_describe(value)}")
        return tuple(convert(item, f"{path}[{i}]") for i, item in enumerate(value))

    return read


def _mapping(value: object, path: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        _fail(path, f"expected a mapping, got {_describe(value)}")
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
        return NamespacedHostname(first, rest)


def _gateway(value: object, path: str, strict: bool = True) -> GatewayAddress:
    obj = _Object(value, path)
    gateway = GatewayAddress(
        destination=obj.need("destination", _gateway_destination),
        hbone_mtls_port=obj.get("hboneMtlsPort", _port, DEFAULT_HBONE_PORT),
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
        name=obj.need("name", _string),
        namespace=obj.need("namespace", _string),
        hostname=obj.need("hostname", _string),
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
    if isinstance(value, _Tagged):
        kind = STRING_MATCH_KINDS.get(value.tag)
        if kind is None:
            _fail(path, f"unknown string match tag '!{value.tag}' (expected {_STRING_MATCH_FORMS})")
        inner = value.value
    elif isinstance(value, dict) and len(value) == 1:
        ((name, inner),) = value.items()
        kind = STRING_MATCH_KINDS.get(name)
        if kind is None:
            _fail(path, f"unknown string match kind {_describe(name)} (expected {_STRING_MATCH_FORMS})")
    else:
        _fail(path, f"expected a string match ({_STRING_MATCH_FORMS}), got {_describe(value)}")
    if kind is StringMatchKind.PRESENCE:
        # Tagged scalars are not resolved, so `!Presence null` arrives as the text "null".
        if inner not in (None, [], {}, "", "~", "null"):
            _fail(path, f"!Presence takes no value ([] or null), got {_describe(inner)}")
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
        name=obj.need("name", _string),
        namespace=obj.need("namespace", _string),
        scope=obj.need("scope", _one_of(SCOPES)),
        action=obj.need("action", _one_of(ACTIONS)),
        # rules (OR) of clauses (AND) of matches (OR)
        rules=obj.need("rules", _list_of(_list_of(_list_of(_match)))),
        dry_run=obj.need("dryRun", _bool),
    )
    obj.refuse_unknown()
    return policy


def _local_config(document: object) -> LocalConfig:
    if document is None:  # an empty file
        return LocalConfig()
    if not isinstance(document, dict):
        _fail("", f"expected a mapping with keys {', '.join(TOP_LEVEL_KEYS)}, got {_describe(document)}")
    obj = _Object(document, "")
    config = LocalConfig(
        workloads=obj.get("workloads", _list_of(_workload), ()),
        services=obj.get("services", _list_of(_service), ()),
        policies=obj.get("policies", _list_of(_policy), ()),
        raw=_plain(document),
    )
    obj.refuse_unknown()
    return config


# --- rendering model values in the same format ------------------------------------------------


def _name(table: Mapping[str, E], value: E) -> str:
    return next(name for name, member in table.items() if member == value)


def _port_map_dict(ports: Iterable[tuple[int, int]]) -> dict[str, int]:
    # String keys: the dict is then equal to its own JSON round trip.
    return {str(svc): target for svc, target in ports}


def gateway_to_dict(gateway: GatewayAddress | None) -> dict[str, Any] | None:
    if gateway is None:
        return None
    return {"destination": str(gateway.destination), "hboneMtlsPort": gateway.hbone_mtls_port}


def endpoint_to_dict(endpoint: Endpoint) -> dict[str, Any]:
    return {
        "workloadUid": endpoint.workload_uid,
        "port": _port_map_dict(endpoint.port),
        "status": _name(STATUSES, endpoint.status),
    }


def workload_to_dict(w: Workload) -> dict[str, Any]:
    tunnel = w.application_tunnel
    return {
        "uid": w.uid,
        "name": w.name,
        "namespace": w.namespace,
        "workloadIps": [str(ip) for ip in w.addresses],
        "hostname": w.hostname,
        "network": w.network,
        "protocol": _name(PROTOCOLS, w.tunnel_protocol),
        "trustDomain": w.trust_domain,
        "serviceAccount": w.service_account,
        "waypoint": gateway_to_dict(w.waypoint),
        "networkGateway": gateway_to_dict(w.network_gateway),
        "node": w.node,
        "canonicalName": w.canonical_name,
        "canonicalRevision": w.canonical_revision,
        "workloadType": w.workload_type,
        "workloadName": w.workload_name,
        "nativeTunnel": w.native_tunnel,
        "applicationTunnel": None
        if tunnel is None
        else {"protocol": _name(APP_TUNNEL_PROTOCOLS, tunnel.protocol), "port": tunnel.port},
        "services": {key: _port_map_dict(ports) for key, ports in w.services},
        "authorizationPolicies": list(w.authorization_policies),
        "status": _name(STATUSES, w.status),
        "clusterId": w.cluster_id,
        "locality": {"region": w.locality.region, "zone": w.locality.zone, "subzone": w.locality.subzone},
        "networkMode": _name(NETWORK_MODES, w.network_mode),
        "capacity": w.capacity,
    }


def service_to_dict(s: Service, endpoints: Iterable[Endpoint] | None = None) -> dict[str, Any]:
    """`endpoints` replaces the service's own list (the store shows the endpoints it has merged)."""
    lb = s.load_balancer
    return {
        "name": s.name,
        "namespace": s.namespace,
        "hostname": s.hostname,
        "vips": [str(vip) for vip in s.vips],
        "cidrVips": [{"network": vip.network, "cidr": str(vip.cidr)} for vip in s.cidr_vips],
        "ports": _port_map_dict(s.ports),
        "endpoints": {
            ep.workload_uid: endpoint_to_dict(ep) for ep in (s.endpoints if endpoints is None else endpoints)
        },
        "subjectAltNames": list(s.subject_alt_names),
        "waypoint": gateway_to_dict(s.waypoint),
        "weightedWaypoints": [
            {"destination": gateway_to_dict(ww.destination), "weight": ww.weight}
            for ww in s.weighted_waypoints
        ],
        "loadBalancer": None
        if lb is None
        else {
            "routingPreferences": [_name(ROUTING_PREFERENCES, scope) for scope in lb.routing_preferences],
            "mode": _name(LOAD_BALANCING_MODES, lb.mode),
            "healthPolicy": _name(HEALTH_POLICIES, lb.health_policy),
        },
        "ipFamilies": None if s.ip_families is IPFamilies.AUTOMATIC else _name(IP_FAMILIES, s.ip_families),
        "canonical": s.canonical,
        "visibility": _name(VISIBILITIES, s.visibility),
    }


def string_match_to_dict(m: StringMatch) -> dict[str, Any]:
    return {m.kind.value: [] if m.kind is StringMatchKind.PRESENCE else m.value}


def match_to_dict(m: Match) -> dict[str, Any]:
    def service_accounts(items: Iterable[ServiceAccountMatch]) -> list[dict[str, str]]:
        return [{"namespace": sa.namespace, "serviceAccount": sa.service_account} for sa in items]

    return {
        "namespaces": [string_match_to_dict(x) for x in m.namespaces],
        "notNamespaces": [string_match_to_dict(x) for x in m.not_namespaces],
        "principals": [string_match_to_dict(x) for x in m.principals],
        "notPrincipals": [string_match_to_dict(x) for x in m.not_principals],
        "sourceIps": [str(net) for net in m.source_ips],
        "notSourceIps": [str(net) for net in m.not_source_ips],
        "destinationIps": [str(net) for net in m.destination_ips],
        "notDestinationIps": [str(net) for net in m.not_destination_ips],
        "destinationPorts": list(m.destination_ports),
        "notDestinationPorts": list(m.not_destination_ports),
        "serviceAccounts": service_accounts(m.service_accounts),
        "notServiceAccounts": service_accounts(m.not_service_accounts),
    }


def policy_to_dict(p: Authorization) -> dict[str, Any]:
    return {
        "name": p.name,
        "namespace": p.namespace,
        "scope": _name(SCOPES, p.scope),
        "action": _name(ACTIONS, p.action),
        "rules": [[[match_to_dict(m) for m in clause] for clause in rule] for rule in p.rules],
        "dryRun": p.dry_run,
    }
