"""The node agent as a real process (root): pods added through the real bridge plugin and `ztunnel-cni`,
ZDS answered by a test-side peer written with `xds.zds`, and real redirection inside a pod.

The peer stands in for ztunnel: it connects to the agent's ZDS socket, sends its hello, and answers
each message (ACK, or the NACK text it is given), recording what it got and which namespace each fd
it received points to.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cni import events, redirect
from tests.cninode import ZTUNNEL, Cluster, Node, Pod, join
from tests.netns import require_root
from tests.waiting import eventually
from xds import zds

pytestmark = pytest.mark.root


@dataclass(frozen=True)
class Received:
    kind: str  # add, keep, del, snapshot_sent
    uid: str = ""
    workload: tuple[str, str, str] = ("", "", "")  # name, namespace, service account
    netns: tuple[int, int] | None = None  # (st_dev, st_ino) of the one fd an Add carries
    fds: int = 0


class ZdsPeer:
    """A stand-in ztunnel on the agent's ZDS socket."""

    def __init__(self, path: Path, nack: str = "") -> None:
        self.nack = nack  # the error text to answer with; "" is ACK
        self.received: queue.Queue[Received] = queue.Queue()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(str(path))
        self.eof = threading.Event()
        zds.send_packet(self.sock, zds.hello())
        self._thread = threading.Thread(target=self._answer, daemon=True)
        self._thread.start()

    def _answer(self) -> None:
        try:
            while (packet := zds.recv_packet(self.sock)) is not None:
                data, fds = packet
                self.received.put(_describe(zds.decode_request(data), fds))
                zds.close_fds(fds)
                zds.send_packet(self.sock, zds.ack(self.nack))
        except OSError:
            pass
        finally:
            self.eof.set()

    def next(self, timeout: float = 5) -> Received:
        return self.received.get(timeout=timeout)

    def snapshot(self, timeout: float = 5) -> list[Received]:
        """The messages up to and including SnapshotSent."""
        got = [self.next(timeout)]
        while got[-1].kind != "snapshot_sent":
            got.append(self.next(timeout))
        return got

    def nothing_more(self, wait: float = 0.2) -> bool:
        try:
            extra = self.received.get(timeout=wait)
        except queue.Empty:
            return True
        raise AssertionError(f"unexpected {extra}")

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(5)
        self.sock.close()


def _describe(req: zds.WorkloadRequest, fds: list[int]) -> Received:
    kind = req.WhichOneof("payload")
    if kind == "add":
        info = req.add.workload_info
        key = None
        if len(fds) == 1:
            st = os.fstat(fds[0])
            key = (st.st_dev, st.st_ino)
        return Received("add", req.add.uid, (info.name, info.namespace, info.service_account), key, len(fds))
    if kind == "keep":
        return Received("keep", req.keep.uid, fds=len(fds))
    if kind == "del":
        return Received("del", getattr(req, "del").uid, fds=len(fds))
    return Received(str(kind), fds=len(fds))


def netns_key(pod: Pod) -> tuple[int, int]:
    st = os.stat(pod.netns_path)
    return (st.st_dev, st.st_ino)


def state(node: Node) -> dict[str, dict[str, object]]:
    return dict(json.loads(node.state_file.read_text())["pods"])


def rules_in_place(pod: Pod) -> bool:
    return redirect.missing_rules(pod.iptables_save()) == []


def no_rules(pod: Pod) -> bool:
    """Neither our chains nor the reply routing are left in the pod."""
    rules, routes = (
        pod.exec("ip", "rule", "show").stdout,
        pod.exec("ip", "route", "show", "table", "100").stdout,
    )
    return "ZTUNNEL" not in pod.iptables_save() and "0x111" not in rules and routes.strip() == ""


def wait_for_log(node: Node, text: str, timeout: float = 3) -> None:
    eventually(lambda: text in node.agent_output(), f"{text!r} in the agent log", timeout, interval=0.02)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    require_root(
        "iptables", "iptables-save", "nsenter", "ip", "/usr/lib/cni/bridge", "/usr/lib/cni/host-local"
    )
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        for node in c.nodes:
            print(f"--- agent log of node {node.index}\n{node.agent_output()}")
        c.close()


@pytest.fixture
def node(cluster: Cluster) -> Node:
    node = cluster.node()
    node.start_agent("--ztunnel-wait", "1")
    return node


@pytest.fixture
def peers(node: Node) -> Iterator[list[ZdsPeer]]:
    """Peers a test connects; closed at the end."""
    made: list[ZdsPeer] = []
    try:
        yield made
    finally:
        for peer in made:
            peer.close()


def connect(node: Node, peers: list[ZdsPeer], nack: str = "") -> tuple[ZdsPeer, list[Received]]:
    peer = ZdsPeer(node.zds_socket, nack)
    peers.append(peer)
    return peer, peer.snapshot()


# -- ADD -------------------------------------------------------------------------------------------


def test_add_installs_rules_and_hands_the_netns_to_ztunnel(node: Node, peers: list[ZdsPeer]) -> None:
    peer, snapshot = connect(node, peers)
    assert snapshot == [Received("snapshot_sent")]

    pod = node.add_pod("web", "demo", "api")

    add = peer.next()
    assert (add.kind, add.uid, add.workload, add.fds) == ("add", pod.uid, ("web", "demo", "api"), 1)
    assert add.netns == netns_key(pod)
    assert rules_in_place(pod)
    assert pod.result is not None and pod.ip.startswith("10.88.")
    assert state(node)[pod.uid] == {
        "name": "web",
        "namespace": "demo",
        "serviceAccount": "api",
        "netns": pod.netns_path,
        "containerId": pod.container_id,
        "ips": [pod.ip],
    }
    assert node.cni_check(pod).ok

    # A second ADD of the same pod: the same answer, one copy of the rules.
    again = node.ztunnel_cni("ADD", pod)
    assert again.ok, again
    assert again.output == pod.result
    assert peer.next().kind == "add"
    saved = pod.iptables_save()
    assert saved.count("-A OUTPUT -j ZTUNNEL-OUTPUT") == 2  # mangle and nat
    assert redirect.missing_rules(saved) == []


def test_add_without_ztunnel_fails_and_leaves_nothing(node: Node) -> None:
    started = time.monotonic()
    result, pod = node.try_add_pod("lonely")
    assert not result.ok
    assert result.error["code"] == events.TRY_AGAIN_LATER
    assert "no ztunnel connected" in result.error["msg"]
    assert time.monotonic() - started < 5
    assert no_rules(pod)
    assert pod.uid not in state(node)


def test_ztunnel_nack_fails_the_add_with_its_text(node: Node, peers: list[ZdsPeer]) -> None:
    peer, _ = connect(node, peers, nack="failure to start proxy : address in use")
    result, pod = node.try_add_pod("web")
    assert not result.ok
    assert result.error["code"] == events.ZTUNNEL_REFUSED
    assert result.error["msg"] == "ztunnel refused pod default/web: failure to start proxy : address in use"
    # The agent undid it: ztunnel is told to forget the uid (else it retries), no rules, no record.
    assert [peer.next().kind, peer.next().kind] == ["add", "del"]
    assert no_rules(pod)
    assert pod.uid not in state(node)


def test_a_ztunnel_that_never_answers_fails_the_add_after_the_deadline(node: Node) -> None:
    # A ztunnel that took the snapshot, then stops answering: one message is outstanding at a time,
    # and after 5 s without its answer the agent drops that ztunnel and fails the ADD.
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    silent.connect(str(node.zds_socket))
    silent.settimeout(10)
    try:
        zds.send_packet(silent, zds.hello())
        packet = zds.recv_packet(silent)
        assert packet is not None and zds.decode_request(packet[0]).WhichOneof("payload") == "snapshot_sent"
        zds.send_packet(silent, zds.ack())
        wait_for_log(node, "snapshot")
        started = time.monotonic()
        result, pod = node.try_add_pod("web")
        elapsed = time.monotonic() - started
        assert not result.ok
        assert result.error["code"] == events.TRY_AGAIN_LATER, result.error
        assert 4.5 <= elapsed < 9, elapsed
        packet = zds.recv_packet(silent)  # the Add it never answered ...
        assert packet is not None and zds.decode_request(packet[0]).WhichOneof("payload") == "add"
        zds.close_fds(packet[1])
        assert zds.recv_packet(silent) is None  # ... and then the agent hung up
        assert no_rules(pod)
        assert pod.uid not in state(node)
    finally:
        silent.close()


# -- DEL and CHECK ---------------------------------------------------------------------------------


def test_del_with_ztunnel_down_succeeds_and_forgets_the_pod(node: Node, peers: list[ZdsPeer]) -> None:
    peer, _ = connect(node, peers)
    pod = node.add_pod("web")
    assert peer.next().kind == "add"
    peer.close()
    wait_for_log(node, "connection #1 closed: ztunnel closed the connection")  # noticed while idle

    results = node.cni_del(pod)
    assert [(r.plugin, r.returncode, r.stdout) for r in results] == [
        ("ztunnel-cni", 0, ""),
        ("bridge", 0, ""),
    ]
    assert no_rules(pod)
    assert state(node) == {}
    check = node.ztunnel_cni("CHECK", pod)
    assert check.error["code"] == events.NOT_ENROLLED
    assert check.error["msg"] == f"pod uid {pod.uid} is not enrolled in the agent"


def test_del_with_the_agent_down_succeeds(node: Node, peers: list[ZdsPeer]) -> None:
    connect(node, peers)
    pod = node.add_pod("web")
    assert node.stop_agent() == 0
    assert all(r.ok and r.stdout == "" for r in node.cni_del(pod))


def test_check_notices_missing_rules(node: Node, peers: list[ZdsPeer]) -> None:
    connect(node, peers)
    pod = node.add_pod("web")
    assert node.cni_check(pod).ok
    pod.exec("iptables", "-t", "nat", "-F", "ZTUNNEL-OUTPUT")
    check = node.cni_check(pod)
    assert check.error["code"] == events.NOT_ENROLLED
    assert "redirection rules missing: -t nat -A ZTUNNEL-OUTPUT" in check.error["msg"]


# -- ZDS conversations -----------------------------------------------------------------------------


def test_a_reconnecting_ztunnel_gets_the_snapshot(node: Node, peers: list[ZdsPeer]) -> None:
    first, _ = connect(node, peers)
    a, b = node.add_pod("a"), node.add_pod("b")
    first.close()

    _, snapshot = connect(node, peers)
    adds = {r.uid: r for r in snapshot[:-1]}
    assert [r.kind for r in snapshot] == ["add", "add", "snapshot_sent"]
    assert adds[a.uid].netns == netns_key(a) and adds[b.uid].netns == netns_key(b)
    assert adds[a.uid].workload == ("a", "default", "default")


def test_add_goes_to_the_newest_ztunnel_and_del_to_all(node: Node, peers: list[ZdsPeer]) -> None:
    old, _ = connect(node, peers)
    new, _ = connect(node, peers)
    pod = node.add_pod("web")
    assert new.next().kind == "add"
    assert old.nothing_more()

    node.del_pod(pod)
    assert old.next() == Received("del", pod.uid)
    assert new.next() == Received("del", pod.uid)


def test_agent_restart_reconciles(node: Node, peers: list[ZdsPeer]) -> None:
    """Pods survive an agent restart; a pod deleted while the agent was down is forgotten."""
    connect(node, peers)
    kept, gone = node.add_pod("kept"), node.add_pod("gone")
    assert node.stop_agent() == 0
    gone.netns.delete()

    node.start_agent("--ztunnel-wait", "1")
    _, snapshot = connect(node, peers)
    assert snapshot == [
        Received("add", kept.uid, ("kept", "default", "default"), netns_key(kept), 1),
        Received("snapshot_sent"),
    ]
    assert list(state(node)) == [kept.uid]
    assert rules_in_place(kept)
    assert node.cni_check(kept).ok
    assert "forgetting pod default/gone" in node.agent_output()


def test_misbehaving_clients_cost_only_their_connection(node: Node, peers: list[ZdsPeer]) -> None:
    # Garbage to the CNI socket: an error reply, the agent carries on.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(node.cni_socket))
        s.sendall(b"{nonsense\n")
        reply = events.decode_reply(s.makefile("rb").readline())
    assert not reply.ok and reply.code == events.INVALID_CONFIG and "invalid request" in reply.error

    # A peer speaking out of turn is dropped.
    rogue, _ = connect(node, peers)
    zds.send_packet(rogue.sock, zds.hello())
    assert rogue.eof.wait(5)

    # Still serving: a good peer enrolls a pod.
    good, _ = connect(node, peers)
    node.add_pod("web")
    assert good.next().kind == "add"
    assert node.agent is not None and node.agent.running()
    assert "unexpected message from ztunnel" in node.agent_output()


def test_hostile_json_events_get_an_error_reply(node: Node, peers: list[ZdsPeer]) -> None:
    """Nesting deeper than the interpreter's stack, or a 5,000-digit number, in an event: the plugin
    gets an error reply (the request's task used to die without one) and the agent carries on."""
    good, _ = connect(node, peers)
    for line in (
        b'{"command": "ADD", "uid": ' + b"[" * 30_000 + b"]" * 30_000 + b"}\n",
        b'{"command": "DEL", "uid": "u", "ips": [' + b"9" * 5000 + b"]}\n",
    ):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(node.cni_socket))
            s.sendall(line)
            reply = events.decode_reply(s.makefile("rb").readline())
        assert not reply.ok and reply.code == events.INVALID_CONFIG
        assert reply.error.startswith("invalid request to the agent: request is not JSON: ")
    node.add_pod("web")
    assert good.next().kind == "add"
    assert "Traceback" not in node.agent_output()


def test_bad_options_are_one_line_errors(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    bad_state = tmp_path / "state.json"
    bad_state.write_text("{oops")

    for args, expected in [
        (["--zds-socket", str(blocker / "z.sock")], f"{blocker} is not a directory"),
        (["--cni-socket", str(blocker)], "exists and is not a socket"),
        (["--state-file", str(bad_state)], "invalid JSON"),
    ]:
        base = ["--zds-socket", str(tmp_path / "z.sock"), "--cni-socket", str(tmp_path / "c.sock")]
        base += ["--state-file", str(tmp_path / "ok.json")]
        done = subprocess.run(
            [str(ZTUNNEL), "cni-agent", *base, *args], capture_output=True, text=True, timeout=10
        )
        assert done.returncode == 1
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ztunnel: cni-agent: ") and expected in lines[0], (
            done.stderr
        )


# -- real redirection in an enrolled pod -----------------------------------------------------------

# Listens on the given ports and prints, per accepted connection, the port, the peer and the
# destination the client dialled (SO_ORIGINAL_DST: SOL_IP=0, option 80, struct sockaddr_in).
CAPTURE = textwrap.dedent(
    """
    import json, selectors, socket, struct, sys
    sel = selectors.DefaultSelector()
    for port in map(int, sys.argv[1:]):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen(16)
        sel.register(s, selectors.EVENT_READ, port)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            c, peer = key.fileobj.accept()
            try:
                raw = c.getsockopt(0, 80, 16)
                dport, dip = struct.unpack("!2xH4s8x", raw)
                dst = f"{socket.inet_ntoa(dip)}:{dport}"
            except OSError:
                dst = None
            print(json.dumps({"port": key.data, "peer": peer[0], "dst": dst}), flush=True)
            c.sendall(b"hi from %d" % key.data)
            c.close()
    """
)

# On 15006, does what ztunnel does with an inbound connection: connects to the destination the client
# dialled from the client's own address (IP_TRANSPARENT, option 19; SO_MARK 1337) and relays a greeting.
RELAY = textwrap.dedent(
    """
    import json, socket, struct
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 15006))
    s.listen(16)
    print("ready", flush=True)
    while True:
        c, peer = s.accept()
        dport, dip = struct.unpack("!2xH4s8x", c.getsockopt(0, 80, 16))
        event = {"port": 15006, "peer": peer[0], "dst": f"{socket.inet_ntoa(dip)}:{dport}"}
        try:
            up = socket.socket()
            up.setsockopt(0, 19, 1)
            up.setsockopt(socket.SOL_SOCKET, 36, 1337)
            up.bind((peer[0], 0))
            up.settimeout(5)
            up.connect((socket.inet_ntoa(dip), dport))
            c.sendall(b"relayed " + up.recv(100))
            up.close()
        except OSError as e:
            event["error"] = str(e)
        print(json.dumps(event), flush=True)
        c.close()
    """
)

# Dials ip:port (with SO_MARK, socket option 36, when given) and prints the greeting.
DIAL = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket()
    if len(sys.argv) > 3:
        s.setsockopt(socket.SOL_SOCKET, 36, int(sys.argv[3]))
    s.settimeout(5)
    s.connect((sys.argv[1], int(sys.argv[2])))
    print(s.recv(100).decode())
    """
)


class Capture:
    """A CAPTURE (or RELAY) process in a pod; its JSON lines are the connections it saw."""

    def __init__(self, pod: Pod, ports: list[int], log: Path, script: str = CAPTURE) -> None:
        self.log = log
        self.proc = pod.popen(["python3", "-c", script, *map(str, ports)], log)
        self.seen = 0
        self._wait(lambda lines: "ready" in lines)

    def _lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def _events(self) -> list[str]:
        return [line for line in self._lines() if line.startswith("{")]

    def _wait(self, done: Callable[[list[str]], bool], timeout: float = 5) -> None:
        def what() -> str:
            return f"capture in {self.log.name}: {self._lines()}"

        eventually(lambda: done(self._lines()) or self.proc.poll() is not None, what, timeout, interval=0.02)
        if not done(self._lines()):
            raise AssertionError(f"exited: {what()}")

    def next(self) -> dict[str, object]:
        """The next connection seen (waiting a while for it)."""
        self._wait(lambda _: len(self._events()) > self.seen)
        self.seen += 1
        return dict(json.loads(self._events()[self.seen - 1]))

    def quiet(self) -> bool:
        """No connection since the last `next`."""
        return len(self._events()) == self.seen

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def dial(pod: Pod, ip: str, port: int, mark: int | None = None) -> str:
    args = ["python3", "-c", DIAL, ip, str(port)] + ([str(mark)] if mark is not None else [])
    return pod.exec(*args).stdout.strip()


def test_real_redirection_in_an_enrolled_pod(cluster: Cluster, tmp_path: Path) -> None:
    a_node, b_node = cluster.node(), cluster.node()
    join(a_node, b_node)
    a_node.start_agent("--ztunnel-wait", "1")
    peer = ZdsPeer(a_node.zds_socket)
    captures: list[Capture] = []
    try:
        peer.snapshot()
        app = a_node.add_pod("app")  # enrolled
        other = b_node.add_pod("other", enrolled=False)  # another node, not in the mesh
        assert peer.next().kind == "add"

        in_app = Capture(app, [15001, 15008], tmp_path / "app-ztunnel.log")
        relay = Capture(app, [], tmp_path / "app-relay.log", RELAY)
        app_server = Capture(app, [8080], tmp_path / "app.log")
        in_other = Capture(other, [8080], tmp_path / "other.log")
        captures += [in_app, relay, app_server, in_other]

        # Outbound: the app dials the other pod; its own 15001 (ztunnel's place) takes it.
        assert dial(app, other.ip, 8080) == "hi from 15001"
        assert in_app.next() == {"port": 15001, "peer": app.ip, "dst": f"{other.ip}:8080"}
        # ... and to an address that does not exist at all.
        assert dial(app, "10.200.0.9", 80) == "hi from 15001"
        assert in_app.next()["dst"] == "10.200.0.9:80"

        # Inbound plaintext to the app lands on 15006, with the port the client dialled. What ztunnel
        # sends on to the app from the client's address reaches it, and the app's replies come back
        # (connmark 0x111, table 100) instead of leaving the pod.
        assert dial(other, app.ip, 8080) == "relayed hi from 8080"
        assert relay.next() == {"port": 15006, "peer": other.ip, "dst": f"{app.ip}:8080"}
        assert app_server.next()["peer"] == other.ip

        # HBONE to 15008 is not redirected: the 15008 listener receives it directly.
        assert dial(other, app.ip, 15008) == "hi from 15008"
        assert in_app.next()["port"] == 15008

        # ztunnel's own sockets (SO_MARK 1337) leave the pod unredirected.
        assert dial(app, other.ip, 8080, mark=1337) == "hi from 8080"
        assert (in_other.next()["peer"], in_other.quiet()) == (app.ip, True)
        assert in_app.quiet()

        # Once ztunnel-cni's DEL ran (the pod's network still up), the app's traffic goes out directly.
        assert a_node.ztunnel_cni("DEL", app).ok
        assert peer.next() == Received("del", app.uid)
        assert dial(app, other.ip, 8080) == "hi from 8080"
        assert in_other.next()["peer"] == app.ip
        assert in_app.quiet() and no_rules(app)
    finally:
        for capture in captures:
            capture.stop()
        peer.close()
