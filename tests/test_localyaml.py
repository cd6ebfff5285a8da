"""The local config's YAML as the reference reads it: YAML 1.2 scalars, text kept as written, JSON's
string keys."""

from __future__ import annotations

from tests.localdocs import (
    parse,
)


def test_yaml_1_2_scalars() -> None:
    # YAML 1.1 would read `no` as false and `010` as eight.
    (w,) = parse(
        "workloads: [{namespace: no, workloadIps: [], capacity: 010, services: {a/b: {0x50: 0o17}}}]"
    ).workloads
    assert w.namespace == "no"
    assert w.capacity == 10
    assert w.services == (("a/b", ((80, 15),)),)


def test_string_fields_take_plain_scalars_as_written() -> None:
    (w,) = parse(
        "workloads: [{namespace: true, workloadIps: [], canonicalRevision: 1.10, name: 010}]"
    ).workloads
    assert (w.namespace, w.canonical_revision, w.name) == ("true", "1.10", "010")


def test_port_map_accepts_string_keys_as_json_writes_them() -> None:
    cfg = parse(
        'services: [{"name": "s", "namespace": "n", "hostname": "h", "vips": [], "ports": {"80": 8080}}]'
    )
    assert cfg.services[0].ports == ((80, 8080),)
