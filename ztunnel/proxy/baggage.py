"""The W3C `baggage` header describing a workload for telemetry."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.model import Workload


@dataclass(frozen=True, slots=True)
class Baggage:
    cluster_id: str = ""
    namespace: str = ""
    workload_type: str = ""
    workload_name: str = ""
    service_name: str = ""
    service_version: str = ""
    region: str = ""
    zone: str = ""


def encode(w: Workload) -> str:
    """`k=v` pairs in the reference's order; empty values are left out."""
    kind = (w.workload_type or "").lower()
    pairs = [
        ("k8s.cluster.name", w.cluster_id),
        ("k8s.namespace.name", w.namespace),
        (f"k8s.{kind}.name" if kind else "", w.workload_name),
        ("service.name", w.canonical_name),
        ("service.version", w.canonical_revision),
        ("cloud.region", w.locality.region),
        ("cloud.availability_zone", w.locality.zone),
    ]
    return ",".join(f"{k}={v}" for k, v in pairs if k and v)


def parse(header: str | None) -> Baggage:
    if not header:
        return Baggage()
    values: dict[str, str] = {}
    kind_name = ("", "")
    for item in header.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep:
            continue
        value = value.split(";", 1)[0].strip()
        if (
            key.startswith("k8s.")
            and key.endswith(".name")
            and key not in ("k8s.cluster.name", "k8s.namespace.name")
        ):
            kind_name = (key[4:-5], value)
        else:
            values[key] = value
    return Baggage(
        cluster_id=values.get("k8s.cluster.name", ""),
        namespace=values.get("k8s.namespace.name", ""),
        workload_type=kind_name[0],
        workload_name=kind_name[1],
        service_name=values.get("service.name", ""),
        service_version=values.get("service.version", ""),
        region=values.get("cloud.region", ""),
        zone=values.get("cloud.availability_zone", ""),
    )
