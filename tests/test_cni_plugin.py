"""The `ztunnel-cni` plugin's side of the CNI spec, and the redirection rules as text (no root needed).

The plugin runs as the runtime runs it (a subprocess with `CNI_*` and the configuration on stdin)
where the exit status and stdout are the point; `handle` is called directly, with a stand-in agent,
to see what the agent is asked.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from cni import events, redirect
from cni.events import PodEvent, Reply
from cni.plugin import CniError, handle, parse_cni_args
from tests.cninode import ZTUNNEL_CNI

PREV_RESULT = {
    "cniVersion": "1.0.0",
    "interfaces": [{"name": "eth0", "mac": "92:df:92:e0:d7:ed", "sandbox": "/var/run/netns/p"}],
    "ips": [
        {"interface": 0, "address": "10.88.1.7/24", "gateway": "10.88.1.1"},
        {"interface": 0, "address": "fd00::7/64"},
    ],
    "routes": [{"dst": "0.0.0.0/0"}],
    "dns": {},
}


def env(
    command: str = "ADD", args: str = "K8S_POD_NAME=web;K8S_POD_NAMESPACE=demo", **extra: str
) -> dict[str, str]:
    return {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": "c0ffee",
        "CNI_NETNS": "/var/run/netns/p",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/usr/lib/cni",
        "CNI_ARGS": args,
        **extra,
    }


def config(prev: dict[str, Any] | None = PREV_RESULT, **extra: Any) -> bytes:
    conf: dict[str, Any] = {"cniVersion": "1.0.0", "name": "mesh", "type": "ztunnel-cni", **extra}
    if prev is not None:
        conf["prevResult"] = prev
    return json.dumps(conf).encode()


class FakeAgent:
    def __init__(self, reply: Reply | CniError = Reply(True)) -> None:
        self.reply = reply
        self.calls: list[tuple[str, PodEvent]] = []

    def __call__(self, path: str, event: PodEvent, timeout: float) -> Reply:
        self.calls.append((path, event))
        if isinstance(self.reply, CniError):
            raise self.reply
        return self.reply


def run_plugin(environ: dict[str, str], stdin: bytes) -> tuple[int, dict[str, Any] | None, str]:
    done = subprocess.run(
        [str(ZTUNNEL_CNI)],
        input=stdin,
        env={"PATH": os.environ["PATH"], **environ},
        capture_output=True,
        timeout=10,
    )
    out = done.stdout.decode()
    return done.returncode, (json.loads(out) if out.strip() else None), done.stderr.decode()


# -- the plugin as the runtime sees it ---------------------------------------------------------------


def test_version_lists_the_supported_versions() -> None:
    code, out, _ = run_plugin({"CNI_COMMAND": "VERSION"}, b'{"cniVersion": "1.0.0"}')
    assert code == 0
    assert out == {"cniVersion": "1.0.0", "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0"]}


@pytest.mark.parametrize(
    ("environ", "stdin", "code", "msg"),
    [
        ({}, config(), 4, "CNI_COMMAND is not set"),
        ({"CNI_COMMAND": "FROB"}, config(), 4, "unknown CNI_COMMAND 'FROB'"),
        ({k: v for k, v in env().items() if k != "CNI_NETNS"}, config(), 4, "CNI_NETNS not set"),
        (env(args="K8S_POD_NAME=web;garbage"), config(), 4, "invalid CNI_ARGS"),
        (env(), b"{not json", 6, "network configuration is not JSON"),
        (env(), b'{"name": "mesh"}', 7, "network configuration without cniVersion"),
        (env(), config(prev=None), 7, "ADD needs prevResult"),
        (
            env(),
            json.dumps({"cniVersion": "9.9.9", "name": "m"}).encode(),
            1,
            "unsupported cniVersion '9.9.9'",
        ),
        (env(args="K8S_POD_NAMESPACE=demo"), config(), 4, "K8S_POD_NAME and K8S_POD_NAMESPACE are required"),
    ],
)
def test_bad_invocations_are_cni_error_objects(
    environ: dict[str, str], stdin: bytes, code: int, msg: str
) -> None:
    rc, out, _ = run_plugin(environ, stdin)
    assert rc != 0
    assert out is not None and set(out) == {"cniVersion", "code", "msg", "details"}
    assert out["code"] == code
    assert msg in out["msg"]


def test_add_with_the_agent_unreachable_fails_try_again_later(tmp_path: Path) -> None:
    rc, out, _ = run_plugin(env(), config(agentSocket=str(tmp_path / "none.sock")))
    assert rc != 0 and out is not None
    assert out["code"] == events.TRY_AGAIN_LATER
    assert out["msg"] == "cannot reach the ztunnel CNI agent"
    assert str(tmp_path / "none.sock") in out["details"]


def test_del_succeeds_silently_when_the_agent_is_down(tmp_path: Path) -> None:
    rc, out, _ = run_plugin(env("DEL"), config(agentSocket=str(tmp_path / "none.sock")))
    assert (rc, out) == (0, None)


def test_disabled_pod_passes_through_without_the_agent(tmp_path: Path) -> None:
    """ISTIO_AMBIENT=disabled: the previous result comes back, and no agent is needed."""
    conf = config(agentSocket=str(tmp_path / "none.sock"))
    rc, out, _ = run_plugin(env(args="ISTIO_AMBIENT=disabled"), conf)
    assert rc == 0
    assert out == PREV_RESULT
    assert run_plugin(env("CHECK", args="ISTIO_AMBIENT=disabled"), conf)[:2] == (0, None)


def test_add_talks_to_the_agent_socket_and_prints_prev_result(tmp_path: Path) -> None:
    """The real protocol over a unix socket: one request line, one reply line."""
    path = tmp_path / "agent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    received: list[bytes] = []

    def agent() -> None:
        conn, _ = server.accept()
        with conn:
            received.append(conn.makefile("rb").readline())
            conn.sendall(Reply(True).encode())

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    try:
        prev = {**PREV_RESULT, "cniVersion": "0.4.0"}
        rc, out, _ = run_plugin(
            env(),
            json.dumps(
                {"cniVersion": "0.4.0", "name": "m", "agentSocket": str(path), "prevResult": prev}
            ).encode(),
        )
    finally:
        thread.join(5)
        server.close()
    assert rc == 0
    assert out == prev  # printed in the configuration's cniVersion
    event = events.decode_event(received[0])
    assert event == PodEvent(
        command="ADD",
        uid="c0ffee",
        name="web",
        namespace="demo",
        service_account="default",
        netns="/var/run/netns/p",
        container_id="c0ffee",
        ips=("10.88.1.7", "fd00::7"),
    )


# -- what the agent is asked ------------------------------------------------------------------------


def test_cni_args_name_the_pod() -> None:
    agent = FakeAgent()
    args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web;K8S_POD_UID=1234-abcd;K8S_POD_SERVICE_ACCOUNT=api;Other=x"
    out = handle(env(args=args), config(agentSocket="/run/a.sock"), agent)
    assert json.loads(out) == PREV_RESULT
    [(path, event)] = agent.calls
    assert path == "/run/a.sock"
    assert (event.command, event.uid, event.name, event.namespace, event.service_account) == (
        "ADD",
        "1234-abcd",
        "web",
        "demo",
        "api",
    )


def test_default_agent_socket() -> None:
    agent = FakeAgent()
    handle(env(), config(), agent)
    assert agent.calls[0][0] == "/var/run/ztunnel/cni-agent.sock"


def test_parse_cni_args() -> None:
    assert parse_cni_args("") == {}
    assert parse_cni_args("A=1;;B=x=y") == {"A": "1", "B": "x=y"}
    with pytest.raises(CniError) as e:
        parse_cni_args("A=1;B")
    assert e.value.code == 4


def test_agent_refusal_is_the_add_error() -> None:
    agent = FakeAgent(
        Reply(False, events.ZTUNNEL_REFUSED, "ztunnel refused pod demo/web: failure to start proxy")
    )
    with pytest.raises(CniError) as e:
        handle(env(), config(), agent)
    assert (e.value.code, e.value.msg) == (101, "ztunnel refused pod demo/web: failure to start proxy")


def test_del_ignores_agent_failures() -> None:
    for reply in (Reply(False, 100, "boom"), CniError(11, "cannot reach the ztunnel CNI agent")):
        agent = FakeAgent(reply)
        assert handle(env("DEL", CNI_NETNS=""), config(prev=None), agent) == ""
        assert agent.calls[0][1].command == "DEL"


def test_check_asks_the_agent() -> None:
    agent = FakeAgent(Reply(False, events.NOT_ENROLLED, "pod uid c0ffee is not enrolled in the agent"))
    with pytest.raises(CniError) as e:
        handle(env("CHECK"), config(), agent)
    assert e.value.code == events.NOT_ENROLLED
    assert agent.calls[0][1].command == "CHECK"


def test_invalid_prev_result_ips() -> None:
    with pytest.raises(CniError) as e:
        handle(env(), config(prev={"ips": [{"address": "nope"}]}), FakeAgent())
    assert e.value.code == 7 and "nope" in e.value.msg


def test_event_decoding_rejects_bad_requests() -> None:
    for line, text in [
        (b"[1]", "not a JSON object"),
        (b'{"command": "ADD"}', "without a uid"),
        (b'{"command": "RM", "uid": "u"}', "is not one of"),
        (b'{"command": "ADD", "uid": "u", "name": "n"}', "ADD request without namespace, netns"),
        (b'{"command": "DEL", "uid": "u", "ips": "1.2.3.4"}', "list of strings"),
    ]:
        with pytest.raises(events.EventError, match=text):
            events.decode_event(line)


# -- the rules as text -------------------------------------------------------------------------------

EMPTY = """*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
COMMIT
"""


def installed(family: redirect.Family = redirect.IPV4) -> str:
    """What iptables-save prints once the rules are in: per table, the jumps first, chains sorted."""
    lines = []
    for table, rules in redirect.chain_rules(family).items():
        lines += [
            f"*{table}",
            ":PREROUTING ACCEPT [0:0]",
            ":OUTPUT ACCEPT [0:0]",
            ":ZTUNNEL-OUTPUT - [0:0]",
            ":ZTUNNEL-PREROUTING - [0:0]",
            "-A PREROUTING -j ZTUNNEL-PREROUTING",
            "-A OUTPUT -j ZTUNNEL-OUTPUT",
            *[r for r in rules if r.startswith("-A ZTUNNEL-OUTPUT")],
            *[r for r in rules if r.startswith("-A ZTUNNEL-PREROUTING")],
            "COMMIT",
        ]
    return "\n".join(lines) + "\n"


def test_the_rules_follow_spec_1_1() -> None:
    rules = redirect.chain_rules()
    assert rules["nat"] == [
        "-A ZTUNNEL-PREROUTING -s 169.254.7.127/32 -j ACCEPT",
        "-A ZTUNNEL-PREROUTING -m mark --mark 0x539/0xfff -j ACCEPT",
        "-A ZTUNNEL-PREROUTING ! -d 127.0.0.1/32 -p tcp -m tcp ! --dport 15008 -j REDIRECT --to-ports 15006",
        "-A ZTUNNEL-OUTPUT -d 169.254.7.127/32 -j ACCEPT",
        "-A ZTUNNEL-OUTPUT -m mark --mark 0x539/0xfff -j ACCEPT",
        "-A ZTUNNEL-OUTPUT ! -o lo -p udp -m udp --dport 53 -j REDIRECT --to-ports 15053",
        "-A ZTUNNEL-OUTPUT ! -o lo -p tcp -m tcp --dport 53 -j REDIRECT --to-ports 15053",
        "-A ZTUNNEL-OUTPUT -o lo -j ACCEPT",
        "-A ZTUNNEL-OUTPUT -d 127.0.0.0/8 -j ACCEPT",
        "-A ZTUNNEL-OUTPUT -p tcp -j REDIRECT --to-ports 15001",
    ]
    assert rules["mangle"] == [
        "-A ZTUNNEL-PREROUTING -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff",
        "-A ZTUNNEL-OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
    ]
    v6 = redirect.chain_rules(redirect.IPV6)["nat"]
    assert (
        "-A ZTUNNEL-PREROUTING ! -d ::1/128 -p tcp -m tcp ! --dport 15008 -j REDIRECT --to-ports 15006" in v6
    )
    assert not any("169.254" in r for r in v6)
    # DNS capture is IPv4 only (the proxy listens on 127.0.0.1), and off with --no-dns-capture.
    assert not any("15053" in r for r in v6)
    assert not any("15053" in r for r in redirect.chain_rules(dns=False)["nat"])


def test_install_script_on_fresh_tables_adds_the_jumps() -> None:
    script = redirect.install_script(EMPTY).splitlines()
    nat = script[script.index("*nat") :]
    assert nat[:3] == ["*nat", ":ZTUNNEL-PREROUTING - [0:0]", ":ZTUNNEL-OUTPUT - [0:0]"]
    assert nat[3:5] == ["-I PREROUTING 1 -j ZTUNNEL-PREROUTING", "-I OUTPUT 1 -j ZTUNNEL-OUTPUT"]
    assert nat[5:] == [*redirect.chain_rules()["nat"], "COMMIT"]
    assert script.count("-I OUTPUT 1 -j ZTUNNEL-OUTPUT") == 2  # mangle and nat
    assert "-t nat -A OUTPUT -j ZTUNNEL-OUTPUT" in redirect.missing_rules(EMPTY)
    assert len(redirect.missing_rules(EMPTY)) == 4 + 2 + 10


def test_install_script_again_keeps_one_jump_each() -> None:
    assert redirect.missing_rules(installed()) == []
    script = redirect.install_script(installed())
    assert "PREROUTING 1" not in script and "-D " not in script
    doubled = installed().replace(
        "-A OUTPUT -j ZTUNNEL-OUTPUT", "-A OUTPUT -j ZTUNNEL-OUTPUT\n-A OUTPUT -j ZTUNNEL-OUTPUT"
    )
    assert redirect.install_script(doubled).count("-D OUTPUT -j ZTUNNEL-OUTPUT") == 2


def test_missing_rules_notices_a_changed_chain() -> None:
    tampered = installed().replace("-A ZTUNNEL-OUTPUT -p tcp -j REDIRECT --to-ports 15001\n", "")
    assert redirect.missing_rules(tampered) == [
        "-t nat -A ZTUNNEL-OUTPUT -p tcp -j REDIRECT --to-ports 15001"
    ]
    extra = installed().replace(
        "-A OUTPUT -j ZTUNNEL-OUTPUT\n-A ZTUNNEL-OUTPUT -d",
        "-A OUTPUT -j ZTUNNEL-OUTPUT\n-A ZTUNNEL-OUTPUT -j ACCEPT\n-A ZTUNNEL-OUTPUT -d",
    )
    assert redirect.missing_rules(extra) == ["-t nat ZTUNNEL-OUTPUT: rules out of order or extra rules"]


def test_remove_script_deletes_jumps_and_chains() -> None:
    assert redirect.remove_script(EMPTY) is None
    section = (
        "-D PREROUTING -j ZTUNNEL-PREROUTING\n-D OUTPUT -j ZTUNNEL-OUTPUT\n"
        "-F ZTUNNEL-PREROUTING\n-X ZTUNNEL-PREROUTING\n-F ZTUNNEL-OUTPUT\n-X ZTUNNEL-OUTPUT\nCOMMIT\n"
    )
    assert redirect.remove_script(installed()) == f"*mangle\n{section}*nat\n{section}"


def test_other_tables_are_not_ours() -> None:
    saved = "*filter\n:OUTPUT ACCEPT [0:0]\n-A OUTPUT -j ZTUNNEL-OUTPUT\nCOMMIT\n" + EMPTY
    assert redirect.table_rules(saved, "nat") == [] and redirect.table_rules(saved, "filter") != []
    assert redirect.remove_script(saved) is None


def test_reply_routing() -> None:
    shown = "0:\tfrom all lookup local\n32764:\tfrom all fwmark 0x111/0xfff lookup 100\n32766:\tfrom all lookup main\n"
    assert redirect.has_reply_routing(shown) == (True, False)
    assert redirect.has_reply_routing(shown + "local default dev lo scope host \n") == (True, True)
    assert redirect.reply_routing_batch(True) == "route replace local 0.0.0.0/0 dev lo table 100\n"
    assert redirect.reply_routing_batch(False, redirect.IPV6).splitlines() == [
        "rule add fwmark 0x111/0xfff pref 32764 lookup 100",
        "route replace local ::/0 dev lo table 100",
    ]
