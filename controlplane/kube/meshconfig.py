"""The mesh config, as istiod reads it from the `istio` ConfigMap of its namespace (`data.mesh`, YAML).

Only what the ambient index takes from it is read: `trustDomain`, the workloads' trust domain (and so
what the principals of policies must name), and `serviceEntryVisibility`, which sets the visibility
of every ServiceEntry from the labels of its namespace. Its policies are tried in order, the first
whose `matchingRules` all match (each a `namespaceSelector`, a label selector) wins, else
`defaultVisibility`; `VISIBILITY_UNSPECIFIED` and an absent `serviceEntryVisibility` are `PUBLIC`.
`NAMESPACE` makes the services visible to the clients of their own namespace only, `NONE` keeps the
ServiceEntry from the data plane altogether. Kubernetes Services are always public, and neither a
ServiceEntry's `exportTo` nor a Service's `networking.istio.io/exportTo` is read: istiod's ambient
index does not read them either.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from controlplane.kube.cluster import items, mapping, string_map, strings, text
from controlplane.kube.manifests import Obj, refuse

MESH_CONFIG_MAP = "istio"
MESH_KEY = "mesh"


class SEVisibility(enum.Enum):
    PUBLIC = "PUBLIC"
    NAMESPACE = "NAMESPACE"
    NONE = "NONE"


_VISIBILITIES = {
    "VISIBILITY_UNSPECIFIED": SEVisibility.PUBLIC,
    "PUBLIC": SEVisibility.PUBLIC,
    "NAMESPACE": SEVisibility.NAMESPACE,
    "NONE": SEVisibility.NONE,
}
_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str  # Equals (from matchLabels), In, NotIn, Exists, DoesNotExist
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.operator == "Exists":
            return present
        if self.operator == "DoesNotExist":
            return not present
        if self.operator == "NotIn":
            return not present or labels[self.key] not in self.values
        return present and labels[self.key] in self.values  # Equals, In


@dataclass(frozen=True, slots=True)
class Rule:
    """A `namespaceSelector`: its requirements, all of which must hold; None: no selector, never matches."""

    requirements: tuple[Requirement, ...] | None

    def matches(self, labels: Mapping[str, str]) -> bool:
        return self.requirements is not None and all(r.matches(labels) for r in self.requirements)


@dataclass(frozen=True, slots=True)
class VisibilityPolicy:
    visibility: SEVisibility
    rules: tuple[Rule, ...]  # all must match; none: matches every namespace


@dataclass(frozen=True, slots=True)
class MeshConfig:
    trust_domain: str = ""  # "": not set (istiod's default, cluster.local)
    default_visibility: SEVisibility = SEVisibility.PUBLIC
    visibility_policies: tuple[VisibilityPolicy, ...] = ()

    def service_entry_visibility(self, namespace_labels: Mapping[str, str]) -> SEVisibility:
        for policy in self.visibility_policies:
            if all(rule.matches(namespace_labels) for rule in policy.rules):
                return policy.visibility
        return self.default_visibility


def _visibility(value: object, where: str) -> SEVisibility:
    name = text(value, where, "VISIBILITY_UNSPECIFIED")
    if name not in _VISIBILITIES:
        refuse(f"{where}: unknown visibility {name!r} (expected one of: {', '.join(_VISIBILITIES)})")
    return _VISIBILITIES[name]


def _selector(value: object, where: str) -> Rule:
    if value is None:
        return Rule(None)
    selector = mapping(value, where)
    requirements = [
        Requirement(k, "Equals", (v,))
        for k, v in string_map(selector.get("matchLabels"), f"{where}.matchLabels").items()
    ]
    for i, raw in enumerate(items(selector.get("matchExpressions"), f"{where}.matchExpressions")):
        expr = mapping(raw, f"{where}.matchExpressions[{i}]")
        operator = text(expr.get("operator"), f"{where}.matchExpressions[{i}].operator")
        if operator not in _OPERATORS:
            refuse(
                f"{where}.matchExpressions[{i}].operator: {operator!r} is not a valid label selector operator"
            )
        values = strings(expr.get("values"), f"{where}.matchExpressions[{i}].values")
        requirements.append(
            Requirement(text(expr.get("key"), f"{where}.matchExpressions[{i}].key"), operator, tuple(values))
        )
    return Rule(tuple(requirements))


def _service_entry_visibility(value: Mapping[str, Any]) -> tuple[SEVisibility, tuple[VisibilityPolicy, ...]]:
    where = "data.mesh: serviceEntryVisibility"
    policies = []
    for i, raw in enumerate(items(value.get("policies"), f"{where}.policies")):
        at = f"{where}.policies[{i}]"
        policy = mapping(raw, at)
        rules = tuple(
            # A rule without a matcher never matches, as istiod compiles an unknown one.
            _selector(
                mapping(rule, f"{at}.matchingRules[{j}]").get("namespaceSelector"),
                f"{at}.matchingRules[{j}].namespaceSelector",
            )
            for j, rule in enumerate(items(policy.get("matchingRules"), f"{at}.matchingRules"))
        )
        policies.append(VisibilityPolicy(_visibility(policy.get("visibility"), f"{at}.visibility"), rules))
    return _visibility(value.get("defaultVisibility"), f"{where}.defaultVisibility"), tuple(policies)


def mesh_config(config_map: Obj) -> MeshConfig:
    """The mesh config of the `istio` ConfigMap; refused (the defaults apply) when it cannot be read."""
    data = mapping(config_map.body.get("data"), "data")
    raw = text(data.get(MESH_KEY), f"data.{MESH_KEY}")
    try:
        mesh = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as e:
        refuse(f"data.{MESH_KEY}: not YAML: {str(e).splitlines()[0]}")
    mesh = mapping(mesh, f"data.{MESH_KEY}")
    trust_domain = text(mesh.get("trustDomain"), "data.mesh: trustDomain")
    visibility = mesh.get("serviceEntryVisibility")
    if visibility is None:
        return MeshConfig(trust_domain)
    default, policies = _service_entry_visibility(mapping(visibility, "data.mesh: serviceEntryVisibility"))
    return MeshConfig(trust_domain, default, policies)
