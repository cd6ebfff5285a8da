"""The CNI plugin's input (its stdin and environment) and the agent's event codec, fed random and
hostile JSON: every invocation ends in output or a `CniError` (a CNI error object on stdout from the
real plugin), every event line in an event or an `EventError`, nothing else. Then the findings of the
first round: 100k-deep JSON, 5,000-digit numbers, and `prevResult` addresses that are not strings.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cni import events
from cni.events import EventError, PodEvent, Reply, decode_event, decode_reply
from cni.plugin import SUPPORTED_VERSIONS, CniError, handle
from tests.test_cni_plugin import PREV_RESULT, config, env, run_plugin

JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=12,
)
ADDRESS = st.one_of(
    st.sampled_from(["10.88.1.7/24", "fd00::7/64", "10.88.1.7", "10.0.0.1/33", "", "x", "::/0"]), JSON
)
PREV = st.one_of(
    st.fixed_dictionaries(
        {"cniVersion": st.sampled_from(SUPPORTED_VERSIONS)},
        optional={"ips": st.one_of(st.lists(st.fixed_dictionaries({}, optional={"address": ADDRESS})), JSON)},
    ),
    JSON,
)
CONF = st.fixed_dictionaries(
    {},
    optional={
        "cniVersion": st.one_of(st.sampled_from([*SUPPORTED_VERSIONS, "0.2.0", ""]), JSON),
        "name": st.one_of(st.just("mesh"), JSON),
        "agentSocket": st.one_of(st.just("/run/agent.sock"), JSON),
        "prevResult": PREV,
    },
)
STDIN = st.one_of(
    CONF.map(lambda c: json.dumps(c).encode()),
    st.binary(max_size=40),
    CONF.map(lambda c: json.dumps(c).encode()[: len(json.dumps(c)) // 2]),
)


def agent(path: str, event: PodEvent, timeout: float) -> Reply:
    return Reply(True)


@given(st.sampled_from(["ADD", "DEL", "CHECK", "VERSION"]), STDIN)
def test_any_stdin_is_output_or_a_cni_error(command: str, stdin: bytes) -> None:
    try:
        out = handle(env(command), stdin, agent)
    except CniError as e:
        json.dumps(e.to_json("1.0.0"))
        return
    if out:
        json.loads(out)


EVENT = st.fixed_dictionaries(
    {},
    optional={
        "command": st.one_of(st.sampled_from(["ADD", "DEL", "CHECK"]), JSON),
        "uid": st.one_of(st.just("u"), JSON),
        "name": st.one_of(st.just("web"), JSON),
        "namespace": st.one_of(st.just("demo"), JSON),
        "netns": st.one_of(st.just("/var/run/netns/p"), JSON),
        "ips": st.one_of(st.just(["10.0.0.1"]), JSON),
    },
)


@given(st.one_of(EVENT.map(lambda e: json.dumps(e).encode()), st.binary(max_size=40)))
def test_any_event_line_is_an_event_or_an_event_error(line: bytes) -> None:
    for decode in (decode_event, decode_reply):
        try:
            decode(line)
        except EventError:
            pass


# -- findings of the first round ------------------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000
HOSTILE_STDIN = {
    "deep": DEEP,
    "deep-in-prev-result": b'{"cniVersion": "1.0.0", "prevResult": ' + DEEP + b"}",
    "5000-digits": b'{"cniVersion": "1.0.0", "name": ' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("command", ["ADD", "DEL"])
@pytest.mark.parametrize("stdin", list(HOSTILE_STDIN.values()), ids=list(HOSTILE_STDIN))
def test_hostile_json_on_stdin_is_a_cni_error_object(command: str, stdin: bytes) -> None:
    rc, out, err = run_plugin(env(command), stdin)
    assert rc == 1 and "Traceback" not in err
    assert out is not None and out["code"] == events.DECODE_FAILURE
    assert out["msg"] == "network configuration is not JSON" and out["cniVersion"] == "1.0.0"


@pytest.mark.parametrize("address", [5, True, None, ["10.0.0.1/24"], {"ip": "10.0.0.1"}])
def test_prev_result_addresses_must_be_cidr_text(address: Any) -> None:
    prev = {**PREV_RESULT, "ips": [{"interface": 0, "address": address}]}
    with pytest.raises(CniError) as caught:
        handle(env("ADD"), config(prev), agent)
    assert caught.value.code == events.INVALID_CONFIG
    assert caught.value.msg == f"prevResult: invalid ips[].address {address!r}"


@pytest.mark.parametrize(
    "line",
    [
        b'{"command": "ADD", "uid": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",
        b'{"command": "ADD", "uid": "u", "ips": [' + b"9" * 5000 + b"]}",
    ],
    ids=["deep", "5000-digits"],
)
def test_hostile_event_lines_are_event_errors(line: bytes) -> None:
    with pytest.raises(EventError, match=r"^request is not JSON: "):
        decode_event(line)
