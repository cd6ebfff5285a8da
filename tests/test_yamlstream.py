"""The local config read entry by entry (`mesh.yamlstream`, the control plane's way): the values of the
whole-document loader for the plain shape, and `Unsupported` (the whole loader reads it instead) for
anything beyond it."""

from __future__ import annotations

import pytest

from mesh import localyaml, yamlstream
from mesh.localconfig import LocalConfigError, parse_local_config
from mesh.yamlvalues import Tagged, WrittenInt

KEYS = ("workloads", "services", "policies")

pytestmark = pytest.mark.skipif(not yamlstream.available(), reason="PyYAML without libyaml")

PLAIN = """\
workloads:
  - {uid: u1, name: a, namespace: ns, workloadIps: ['10.0.0.1'], canonicalRevision: 010,
     services: {'ns/s.ns': {80: 8080}}, nativeTunnel: true, node: ~, capacity: 0x10}
  - uid: "u2"
    namespace: ns
    workloadIps: [10.0.0.2]
    hostname: ''
services: null
policies:
  - {name: p, namespace: ns, scope: Namespace, action: Allow, dryRun: False,
     rules: [[[{principals: [!Prefix 'cluster.local/ns/ns/'], notPrincipals: [!Presence []]}]]]}
"""


def _entries(text: str) -> dict[str, list[object]]:
    read: dict[str, list[object]] = {}
    for key, entry in yamlstream.items(text, KEYS):
        read.setdefault(key, []).append(entry)
    return read


def test_plain_entries_are_the_whole_loaders_values() -> None:
    whole = localyaml.load(PLAIN)
    read = _entries(PLAIN)
    assert read == {"workloads": whole["workloads"], "policies": whole["policies"]}
    first = read["workloads"][0]
    assert isinstance(first, dict)
    revision = first["canonicalRevision"]
    assert isinstance(revision, WrittenInt) and revision.text == "010" and revision == 10
    assert first["capacity"] == 16 and first["node"] is None and first["nativeTunnel"] is True
    policy = read["policies"][0]
    assert isinstance(policy, dict)
    (((match,),),) = policy["rules"]
    assert match["principals"] == [Tagged("Prefix", "cluster.local/ns/ns/")]


@pytest.mark.parametrize(
    "text",
    [
        "workloads: [{a: &x 1}]\n",  # anchors and aliases
        "workloads: [{a: 1, b: *x}]\n",
        "workloads: [{<<: {a: 1}}]\n",  # a merge key
        "workloads: [{a: !!str 1}]\n",  # explicit tags
        "workloads: [{a: 1.5}]\n",  # floats
        "workloads: [{a: 1, a: 2}]\n",  # duplicate keys
        "workloads: [{!Exact [1]: 2}]\n",  # unhashable keys
        "workloads: [{[1]: 2}]\n",
        "workloads: []\nworkloads: []\n",
        "other: []\n",  # keys the format has not
        "workloads: {}\n",  # not a list
        "- 1\n",  # not a mapping
        "",  # no document
        "workloads: []\n---\nworkloads: []\n",
        "workloads: [{a: [}\n",  # not YAML
        "workloads: " + "[" * 101 + "]" * 101 + "\n",  # nested too deep
    ],
)
def test_anything_else_is_left_to_the_whole_loader(text: str) -> None:
    with pytest.raises(yamlstream.Unsupported):
        _entries(text)


def test_errors_are_the_whole_loaders() -> None:
    """An entry that does not convert: the same key path and reason as when read whole."""
    text = PLAIN.replace("namespace: ns\n    workloadIps", "workloadIps")
    with pytest.raises(LocalConfigError) as whole:
        parse_local_config(text, "mesh.yaml")
    with pytest.raises(LocalConfigError) as streamed:
        parse_local_config(text, "mesh.yaml", raw=False)
    assert (
        streamed.value.message
        == whole.value.message
        == "mesh.yaml: workloads[1].namespace: missing required key"
    )
    bad = PLAIN + "  - [\n"
    with pytest.raises(LocalConfigError) as yaml_error:
        parse_local_config(bad, "mesh.yaml", raw=False)
    assert yaml_error.value.message.startswith("mesh.yaml: line ")


def test_the_same_config_without_its_raw_document() -> None:
    whole = parse_local_config(PLAIN)
    streamed = parse_local_config(PLAIN, raw=False)
    assert streamed == whole and streamed.raw == {} and whole.raw
    assert len(streamed.workloads) == 2 and len(streamed.policies) == 1
