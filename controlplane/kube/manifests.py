"""Reading Kubernetes manifests: files, documents, objects.

A path is one manifest file or a directory of them (`*.yaml`, `*.yml`, `*.json`, not recursive,
in name order). A file holds one or more YAML documents separated by `---`; a document is an object
or a `kind: List` (as `kubectl get -o yaml` prints several) whose `items` are objects. YAML is read as
`kubectl` reads it (YAML 1.1 scalars), so an unquoted `version: 1.0` label is a number, which
Kubernetes refuses, and so do we.

Objects are kept as they are written, wrapped in `Obj` for their identity and metadata. Only the
kinds the ambient index reads are kept (`READ_KINDS`); the others (Deployments, Secrets, ...) are
counted and reported once. An object without a name, or with metadata Kubernetes would refuse, is a
`Refusal` naming its kind, namespace, name and the reason.
"""

from __future__ import annotations

import datetime
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml

from mesh.localconfig import describe_value

# (API group, kind) of every object the index reads. The core group is "".
READ_KINDS = {
    ("", "ConfigMap"),  # the mesh config's; other ConfigMaps are read and left alone
    ("", "Namespace"),
    ("", "Node"),
    ("", "Pod"),
    ("", "Service"),
    ("discovery.k8s.io", "EndpointSlice"),
    ("networking.istio.io", "ServiceEntry"),
    ("networking.istio.io", "WorkloadEntry"),
    ("security.istio.io", "AuthorizationPolicy"),
    ("security.istio.io", "PeerAuthentication"),
    ("gateway.networking.k8s.io", "Gateway"),
    ("gateway.networking.k8s.io", "GatewayClass"),
}
CLUSTER_SCOPED = {"Namespace", "Node", "GatewayClass"}
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")

_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ManifestError(ValueError):
    """A file that cannot be read or parsed; the message names the file and the place."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Refused(Exception):
    """One object cannot be converted; `reason` says why (the caller knows which object)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def refuse(reason: str) -> NoReturn:
    raise Refused(reason)


@dataclass(frozen=True, slots=True)
class Refusal:
    """An object left out of what is served, and why."""

    kind: str
    namespace: str
    name: str
    reason: str
    where: str = ""

    def __str__(self) -> str:
        who = f"{self.namespace}/{self.name}" if self.namespace else self.name or "(no name)"
        prefix = f"{self.where}: " if self.where else ""
        return f"{prefix}{self.kind} {who} refused: {self.reason}"


@dataclass(frozen=True, eq=False)
class Obj:
    """One Kubernetes object as written; `body` is the whole document."""

    group: str
    kind: str
    namespace: str
    name: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    body: Mapping[str, Any]
    where: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> Mapping[str, Any]:
        spec = self.body.get("spec")
        return spec if isinstance(spec, dict) else {}

    @property
    def status(self) -> Mapping[str, Any]:
        status = self.body.get("status")
        return status if isinstance(status, dict) else {}

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name

    @property
    def created(self) -> str:
        """`creationTimestamp` as written (RFC 3339 sorts as text); "" when absent, which sorts first."""
        value = self.metadata.get("creationTimestamp")
        if isinstance(value, datetime.datetime):  # unquoted, YAML 1.1 reads a timestamp
            utc = value.astimezone(datetime.UTC) if value.tzinfo else value
            return utc.strftime("%Y-%m-%dT%H:%M:%SZ")
        return str(value) if value is not None else ""

    def refusal(self, reason: str) -> Refusal:
        return Refusal(self.kind, self.namespace, self.name, reason, self.where)


def manifest_files(path: Path) -> list[Path]:
    """The files a `--kube` path names: itself, or a directory's manifest files in name order."""
    if path.is_dir():
        return sorted(
            p
            for p in path.iterdir()
            if p.suffix in MANIFEST_SUFFIXES and p.is_file() and not p.name.startswith(".")
        )
    return [path]


def parse_documents(text: str, source: str) -> list[object]:
    """The YAML documents of one file; a syntax error is a `ManifestError` naming line and column."""
    try:
        return list(yaml.load_all(text, Loader=_Loader))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ManifestError(f"{source}: {where}invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ManifestError(f"{source}: invalid YAML: {e}") from None
    except (ValueError, TypeError, RecursionError) as e:
        raise ManifestError(f"{source}: invalid YAML: {e}") from None


def read_file(path: Path) -> list[object]:
    source = os.fspath(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ManifestError(f"{source}: cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError(f"{source}: not UTF-8 text") from None
    return parse_documents(text, source)


@dataclass
class Objects:
    """What a set of documents holds: the objects read, those refused, and the kinds not read."""

    objects: list[Obj] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    ignored: Counter[str] = field(default_factory=Counter)


def _flatten(documents: list[object], source: str) -> Iterator[tuple[str, object]]:
    for i, doc in enumerate(documents):
        if doc is None:  # an empty document (`---` at the start or the end)
            continue
        where = f"{source} document {i + 1}"
        if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            for j, item in enumerate(doc["items"]):
                yield f"{where} item {j + 1}", item
        else:
            yield where, doc


def _string_map(value: object, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        refuse(f"{where}: expected a mapping, got {describe_value(value)}")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            bad = k if not isinstance(k, str) else v
            refuse(f"{where}.{k}: expected a string, got {describe_value(bad)} (quote it)")
        out[k] = v
    return out


def _object(doc: object, where: str, into: Objects) -> None:
    if not isinstance(doc, dict):
        into.refusals.append(
            Refusal("(unknown)", "", "", f"expected an object, got {describe_value(doc)}", where)
        )
        return
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    if not isinstance(kind, str) or not isinstance(api_version, str):
        into.refusals.append(Refusal(str(kind or "(no kind)"), "", "", "missing kind or apiVersion", where))
        return
    group = api_version.rpartition("/")[0] if "/" in api_version else ""
    if (group, kind) not in READ_KINDS:
        into.ignored[f"{kind} ({api_version})"] += 1
        return
    meta = doc.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    name = meta.get("name")
    namespace = "" if kind in CLUSTER_SCOPED else meta.get("namespace") or "default"
    if not isinstance(namespace, str):
        into.refusals.append(Refusal(kind, "", str(name), "metadata.namespace: expected a string", where))
        return
    if not isinstance(name, str) or not name:
        into.refusals.append(Refusal(kind, namespace, "", "metadata.name: required", where))
        return
    try:
        labels = _string_map(meta.get("labels"), "metadata.labels")
        annotations = _string_map(meta.get("annotations"), "metadata.annotations")
    except Refused as e:
        into.refusals.append(Refusal(kind, namespace, name, e.reason, where))
        return
    into.objects.append(Obj(group, kind, namespace, name, labels, annotations, doc, where, meta))


def objects_of(documents: list[object], source: str) -> Objects:
    """The objects of one file's documents (lists expanded)."""
    out = Objects()
    for where, doc in _flatten(documents, source):
        _object(doc, where, out)
    return out
