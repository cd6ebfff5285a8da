"""The local-config loader fed random YAML: documents built from the format's own keys, YAML tags
(the core schema's explicit ones and the string-match tags), anchors and aliases, and the example
file with characters inserted and deleted. Every input gives a `LocalConfig` whose `raw` form is
JSON, or a `LocalConfigError`; nothing else. Then the findings of the first round, and the development
control plane's file watcher living through them.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from google.protobuf.message import Message
from hypothesis import assume, given
from hypothesis import strategies as st

from controlplane.snapshot import Snapshot
from controlplane.source import ConfigSource
from mesh.localconfig import (
    LocalConfig,
    LocalConfigError,
    parse_local_config,
)
from mesh.model import ConversionError, Service, Workload
from mesh.render import (
    policy_to_dict,
    service_to_dict,
    workload_to_dict,
)
from tests.conftest import LogLines
from tests.fuzz.test_fuzz_xds import authorizations, services, workloads
from tests.waiting import eventually_async
from xds import convert
from xds.gen.istio.workload import workload_pb2

KEYS = [
    "workloads", "services", "policies", "uid", "name", "namespace", "workloadIps", "protocol", "services",
    "vips", "ports", "hostname", "rules", "scope", "action", "dryRun", "principals", "sourceIps",
    "destinationPorts", "waypoint", "destination", "hboneMtlsPort", "applicationTunnel", "port", "cidrVips",
    "cidr", "endpoints", "loadBalancer", "capacity", "<<",
]  # fmt: skip
TAGS = [
    "!!float", "!!int", "!!bool", "!!null", "!!str", "!!timestamp", "!!binary", "!!set", "!!omap",
    "!!pairs", "!!seq", "!!map", "!!merge", "!!python/tuple", "!Exact", "!Prefix", "!Suffix", "!Presence",
    "!Other", "!<tag:yaml.org,2002:int>",
]  # fmt: skip
SCALARS = st.one_of(
    st.sampled_from(["''", '""', "~", "null", "true", "no", "010", "0x1F", "1e999", "-.inf", ".nan", "80"]),
    st.sampled_from(
        ["65616", "-1", "10.0.0.1", "/10.0.0.1", "10.0.0.0/33", "ns/h", "HBONE", "Deny", "2001::1"]
    ),
    st.sampled_from(["2026-13-01", "nope", "'%%%'", "[]", "{}", "9" * 5000, "'a\\x00'"]),
    st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=5).map(json.dumps),
)
ANCHOR = st.sampled_from(["a", "b", "c"])


def _node(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    pair = st.tuples(st.one_of(st.sampled_from(KEYS), children), children).map(lambda kv: f"{kv[0]}: {kv[1]}")
    return st.one_of(
        st.lists(children, max_size=4).map(lambda items: "[" + ", ".join(items) + "]"),
        st.lists(pair, max_size=4).map(lambda items: "{" + ", ".join(items) + "}"),
        st.tuples(st.sampled_from(TAGS), children).map(" ".join),
        st.tuples(ANCHOR, children).map(lambda x: f"&{x[0]} {x[1]}"),
    )


VALUES = st.recursive(st.one_of(SCALARS, ANCHOR.map(lambda a: f"*{a}")), _node, max_leaves=30)
DOCUMENTS = st.one_of(
    st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=4).map(
        lambda kvs: "".join(f"{k}: {v}\n" for k, v in kvs)
    ),
    VALUES,
)

EXAMPLE = """\
workloads:
  - uid: t//v1/Pod/demo/a
    name: a
    namespace: demo
    workloadIps: ["10.0.0.1"]
    protocol: HBONE
    services:
      "demo/s.demo": {80: 8080}
    applicationTunnel: {protocol: PROXY, port: 15088}
services:
  - name: s
    namespace: demo
    hostname: s.demo
    vips: ["/10.96.0.1"]
    ports: {80: 8080}
    cidrVips: [{network: "", cidr: "10.97.0.0/16"}]
policies:
  - name: p
    namespace: demo
    scope: Namespace
    action: Allow
    dryRun: false
    rules: [[[{principals: [!Exact "cluster.local/ns/demo/sa/a"], destinationPorts: [80]}]]]
"""


@st.composite
def edited_example(draw: st.DrawFn) -> str:
    text = EXAMPLE
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        if draw(st.booleans()) and i < len(text):
            text = text[:i] + text[i + draw(st.integers(1, 8)) :]
        else:
            text = (
                text[:i]
                + draw(st.sampled_from(["[", "]", "{", ":", "&a ", "*a", "!!float ", "- ", "\n  ", "'"]))
                + text[i:]
            )
    return text


def _load(text: str) -> LocalConfig | LocalConfigError:
    try:
        config = parse_local_config(text, "fuzz.yaml")
    except LocalConfigError as e:
        assert e.message.startswith("fuzz.yaml: ") and "\n" not in e.message.strip()
        _same_without_raw(text, e)
        return e
    json.dumps(config.raw)  # `/config_dump` echoes it
    _same_without_raw(text, config)
    return config


def _same_without_raw(text: str, whole: LocalConfig | LocalConfigError) -> None:
    """The control plane's reading (entry by entry where it can) gives the same config or error."""
    try:
        streamed: LocalConfig | LocalConfigError = parse_local_config(text, "fuzz.yaml", raw=False)
    except LocalConfigError as e:
        assert isinstance(whole, LocalConfigError) and e.message == whole.message
        return
    assert streamed == whole


@given(DOCUMENTS)
def test_random_documents_load_or_are_refused(text: str) -> None:
    _load(text)


@given(edited_example())
def test_edited_example_loads_or_is_refused(text: str) -> None:
    _load(text)


def test_the_example_loads() -> None:
    config = _load(EXAMPLE)
    assert isinstance(config, LocalConfig) and len(config.workloads) == 1 and len(config.policies) == 1


# -- findings of the first round ------------------------------------------------------------------

BOMB = "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9 if prev else ['x'] * 9)}]\n"
    for prev, name in zip(["", "a", "b", "c", "d", "e", "f", "g"], "abcdefgh", strict=True)
)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("workloads: !!float ''", "line 1, column 12: invalid YAML: invalid tag:yaml.org,2002:float value ''"),
        ("workloads: !!timestamp nope", "invalid tag:yaml.org,2002:timestamp value 'nope'"),
        ("{!Exact [1]: 2}", "line 1, column 2: invalid YAML: found unhashable key"),
        ("x: &a [*a]", "line 1, column 8: invalid YAML: recursive alias *a (inside its own anchor)"),
        ("workloads: " + "[" * 3000 + "]" * 3000, "invalid YAML: nested deeper than 100 levels"),
        ("workloads:\n" + "".join("  " * i + "- \n" for i in range(1, 3000)), "nested deeper than 100 levels"),
        ("workloads: " + "{a: " * 3000 + "1" + "}" * 3000, "nested deeper than 100 levels"),
        (BOMB, "invalid YAML: aliases expand to more than 100000 values"),
        ("workloads: []\n" + BOMB.replace("\n", "\n  ").replace("a: &a", "ignored:\n  a: &a", 1), "aliases expand"),
        ("workloads: " + "9" * 5000, "invalid YAML: invalid integer"),
    ],
    ids=["float", "timestamp", "tagged-key", "recursive-alias", "deep-flow", "deep-block", "deep-map", "bomb",
         "bomb-in-ignored-key", "5000-digits"],
)  # fmt: skip
def test_hostile_yaml_is_a_local_config_error(text: str, reason: str) -> None:
    start = time.monotonic()
    with pytest.raises(LocalConfigError) as caught:
        parse_local_config(text, "cfg.yaml")
    assert caught.value.message.startswith("cfg.yaml: ") and reason in caught.value.message
    # Rejected fast: the alias bomb used to take seconds, deep nesting to end in RecursionError.
    assert time.monotonic() - start < 3.0


def test_a_document_within_the_bounds_still_loads() -> None:
    nested = "[" * 90 + "]" * 90
    aliases = "x: &x [1, 2, 3]\n" + "".join(f"y{i}: *x\n" for i in range(100))
    for text in (f"workloads: []\nextra: {nested}\n", f"workloads: []\n{aliases}"):
        with pytest.raises(LocalConfigError, match="unknown key"):  # loaded: only the key is wrong
            parse_local_config(text)


# -- the control plane's file watcher -------------------------------------------------------------

GOOD = EXAMPLE
BAD_SAVES = [
    "workloads: !!float ''",
    "x: &a [*a]",
    "workloads: " + "[" * 3000 + "]" * 3000,
    BOMB,
    "{!Exact [1]: 2}",
]


async def test_the_file_watcher_survives_bad_saves_and_publishes_a_later_good_one(
    tmp_path: Path, proxy_logs: LogLines
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("workloads: []\n")
    source = ConfigSource(path, poll_interval=0.02)
    first = source.load()
    published: list[Snapshot] = []
    watch = asyncio.create_task(source.watch(published.append))
    try:
        for i, bad in enumerate(BAD_SAVES):
            path.write_text(bad + "\n" + "#" * i)  # a different size each time: a new signature
            await eventually_async(
                lambda n=i: proxy_logs.text().count("refused the changed configuration") > n,  # type: ignore[misc]
                f"bad save {i} refused",
            )
        assert not published and not watch.done()
        path.write_text(GOOD)
        await eventually_async(lambda: len(published) == 1, "the good save published")
        assert "Traceback" not in proxy_logs.text()
        assert published[0] != first
    finally:
        watch.cancel()


# -- what `/config_dump` renders reads back equal ---------------------------------------------------


def _slash_in_names(message: Message) -> bool:
    for descriptor, value in message.ListFields():
        if descriptor.name in ("network", "namespace") and isinstance(value, str) and "/" in value:
            return True
        if descriptor.message_type is None or descriptor.message_type.GetOptions().map_entry:
            continue
        if any(_slash_in_names(m) for m in (value if descriptor.is_repeated else [value])):
            return True
    return False


@given(st.one_of(workloads(), services()), authorizations())
def test_rendered_model_values_read_back_equal(address: workload_pb2.Address, policy: object) -> None:
    try:
        item = convert.address_from_wire(address)
        authorization = convert.authorization_from_wire(policy)  # type: ignore[arg-type]
    except ConversionError:
        return
    # The file writes addresses as "<network>/<ip>" and gateways also as "<namespace>/<hostname>": a
    # network or namespace with a '/' (which Kubernetes never has) has no spelling there.
    assume(not _slash_in_names(address))
    # Ports are a map there: a wire list repeating a service port has no spelling either.
    port_lists = [ports for _, ports in item.services] if isinstance(item, Workload) else [item.ports]
    assume(all(len({svc for svc, _ in ports}) == len(ports) for ports in port_lists))
    document = {
        "workloads": [workload_to_dict(item)] if isinstance(item, Workload) else [],
        "services": [service_to_dict(item)] if isinstance(item, Service) else [],
        "policies": [policy_to_dict(authorization)],
    }
    config = parse_local_config(json.dumps(document))
    assert (*config.workloads, *config.services) == (item,)
    assert config.policies == (authorization,)


def test_json_escapes_of_one_character_above_u_ffff_read_as_that_character() -> None:
    # As `/config_dump` (JSON) writes a name with an emoji; PyYAML alone reads two lone surrogates.
    config = parse_local_config(json.dumps({"policies": [{**_POLICY, "namespace": "ns-\U0001f600"}]}))
    assert config.policies[0].namespace == "ns-\U0001f600"
    with pytest.raises(LocalConfigError, match="unpaired surrogate"):
        parse_local_config('policies: [{name: "\\ud83d"}]')


_POLICY = {"name": "p", "scope": "Global", "action": "Allow", "dryRun": False, "rules": []}
