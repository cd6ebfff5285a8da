"""A deleted pod's connections are drained before its namespace is let go (root: a node built from
network namespaces, its real node agent, `ztunnel proxy` in shared mode; tests/inpod_mesh.py).

The test deletes a pod through the runtime's CNI DEL while connections into it and out of it are
open, and watches their peers: an HBONE client of the pod's 15008 and an HBONE server the pod's pool
dialled (both raw HTTP/2 peers of the test, reading every frame), and plain TCP peers on either side.
Each must see GOAWAY and the stream's clean end, or the data in flight then a FIN, before the DEL
returns; never a reset, never a timeout. Another pod's connection, and its own pooled HBONE
connection to the same server, carry on.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from tests.cninode import CniResult, Node, Pod
from tests.inpod_mesh import (
    PROXY_PORTS,
    TD,
    Mesh,
    hold,
    listening_ports,
    mesh_fixture,  # noqa: F401 (a fixture)
    start_node,
    workload_yaml,
)
from tests.waiting import eventually

pytestmark = [pytest.mark.timeout(120), pytest.mark.root]

BURST = 65536

# Raw HTTP/2 over the fake CA's mTLS (every ztunnel of the test trusts it), frames read one by one.
H2 = """
import asyncio, struct, sys
import hpack
from hbone.identity import Identity
from hbone.tls import TlsCredentials
from ztunnel.identity.certificates import FakeCA

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0, 1, 3, 4, 6, 7
END_STREAM = ACK = 1
END_HEADERS = 4

def credentials(uri):
    return TlsCredentials.build(FakeCA().issue(Identity.parse(uri)))

def frame(ftype, flags, sid, payload=b""):
    n = len(payload)
    return struct.pack(">HBBBL", n >> 8, n & 0xFF, ftype, flags, sid) + payload

async def next_frame(reader):
    head = await reader.readexactly(9)
    hi, lo, ftype, flags, sid = struct.unpack(">HBBBL", head)
    return ftype, flags, sid & 0x7FFFFFFF, await reader.readexactly((hi << 8) | lo)

def say(*words):
    print(*words, flush=True)
"""

# argv: own identity. An HBONE server on :15008 that answers every CONNECT with 200 and echoes its
# bytes, ends a stream when its client does, and says what each connection (its client's service
# account, #its number) sent, with the port its streams asked for. A CONNECT to port 8081 is answered only once told to (a line
# on stdin).
FAKE_SERVER = (
    H2
    + """
told = None
connections = 0

async def answer(writer, encoder, sid, port, early):
    global told
    if port == "8081":
        say("delaying")
        told = told or asyncio.ensure_future(asyncio.to_thread(sys.stdin.readline))
        await told
    writer.write(frame(HEADERS, END_HEADERS, sid, encoder.encode([(":status", "200")])))
    for data in early.pop(sid):  # what came before the answer, echoed after it
        writer.write(frame(DATA, 0, sid, data))

async def serve(reader, writer):
    cert = writer.get_extra_info("peercert") or {}
    global connections
    connections += 1
    sa = next((v.rsplit("/", 1)[1] for k, v in cert.get("subjectAltName", ()) if k == "URI"), "?")
    who = f"{sa}#{connections}"
    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    ports, answers, early = {}, set(), {}
    try:
        await reader.readexactly(24)  # the client preface
        writer.write(frame(SETTINGS, 0, 0))
        while True:
            ftype, flags, sid, payload = await next_frame(reader)
            if ftype == SETTINGS and not flags & ACK:
                writer.write(frame(SETTINGS, ACK, 0))
            elif ftype == PING and not flags & ACK:
                writer.write(frame(PING, ACK, 0, payload))
            elif ftype == HEADERS:
                ports[sid] = dict(decoder.decode(payload))[":authority"].rsplit(":", 1)[1]
                early[sid] = []
                answering = asyncio.ensure_future(answer(writer, encoder, sid, ports[sid], early))
                answers.add(answering)
                answering.add_done_callback(answers.discard)
            elif ftype == DATA:
                if sid in early:
                    early[sid].append(payload)
                elif payload:
                    writer.write(frame(DATA, 0, sid, payload))
                if flags & END_STREAM:
                    say(who, "end_stream", ports[sid])
                    writer.write(frame(DATA, END_STREAM, sid))
            elif ftype == RST_STREAM:
                say(who, "rst", ports[sid], struct.unpack(">L", payload[:4])[0])
            elif ftype == GOAWAY:
                say(who, "goaway", struct.unpack(">L", payload[4:8])[0])
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        say(who, "eof" if isinstance(e, asyncio.IncompleteReadError) else type(e).__name__)

async def main():
    server = await asyncio.start_server(serve, "0.0.0.0", 15008, ssl=credentials(sys.argv[1]).server)
    say("listening")
    await server.serve_forever()

asyncio.run(main())
"""
)

# argv: ip, own identity. An HBONE client of ip:15008: one CONNECT to ip:8080 and its echo, then every
# frame that comes, a stream's end answered with ours, until the connection closes.
RAW_CLIENT = (
    H2
    + """
async def main():
    ip = sys.argv[1]
    reader, writer = await asyncio.open_connection(
        ip, 15008, ssl=credentials(sys.argv[2]).client, server_hostname=""
    )
    block = hpack.Encoder().encode([(":method", "CONNECT"), (":authority", f"{ip}:8080")])
    writer.write(b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n" + frame(SETTINGS, 0, 0))
    writer.write(frame(HEADERS, END_HEADERS, 1, block) + frame(DATA, 0, 1, b"in-hbone"))
    echoed = b""
    try:
        while True:
            ftype, flags, sid, payload = await asyncio.wait_for(next_frame(reader), 20)
            if ftype == SETTINGS and not flags & ACK:
                writer.write(frame(SETTINGS, ACK, 0))
            elif ftype == PING and not flags & ACK:
                writer.write(frame(PING, ACK, 0, payload))
            elif ftype == DATA:
                echoed += payload
                if echoed == b"in-hbone" and payload:
                    say("held")
                if flags & END_STREAM:
                    say("end_stream")
                    writer.write(frame(DATA, END_STREAM, sid))
            elif ftype == RST_STREAM:
                say("rst", struct.unpack(">L", payload[:4])[0])
            elif ftype == GOAWAY:
                say("goaway", struct.unpack(">L", payload[4:8])[0])
            await writer.drain()
    except asyncio.IncompleteReadError:
        say("eof")
    except (TimeoutError, ConnectionError) as e:
        say(type(e).__name__)

asyncio.run(main())
"""
)

# argv: fake's ip, plain's ip. The deleted pod's app: an echo server on 8080, a burst of BURST bytes
# to every client of 8082 (then the connection held: "flushed" once they have all left its socket),
# and one connection out to each ip, held.
POD_APP = f"""
import fcntl, socket, struct, sys, termios, threading, time
held = []
def burst(c):
    c.sendall(b"x" * {BURST})
    deadline = time.monotonic() + 10
    while struct.unpack("i", fcntl.ioctl(c, termios.TIOCOUTQ, b"    "))[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    print("flushed", flush=True)
def echo(c):
    while data := c.recv(65536):
        c.sendall(data)
def serve(port, handle):
    srv = socket.create_server(("0.0.0.0", port))
    while True:
        c, _ = srv.accept()
        held.append(c)
        threading.Thread(target=handle, args=(c,), daemon=True).start()
threading.Thread(target=serve, args=(8080, echo), daemon=True).start()
threading.Thread(target=serve, args=(8082, burst), daemon=True).start()
def talk(ip, port, message):
    s = socket.create_connection((ip, port), timeout=10)
    s.sendall(message)
    got = b""
    while len(got) < len(message):
        got += s.recv(100)
    held.append(s)
for ip, port, message in ((sys.argv[1], 8080, b"out-hbone"), (sys.argv[2], 8090, b"out-tcp")):
    talk(ip, port, message)
print("ready", flush=True)
# One more, whose upstream is still being set up (its CONNECT not answered) when the pod goes.
talk(sys.argv[1], 8081, b"slow")
print("slow echoed", flush=True)
threading.Event().wait()
"""

# The plain pod's server on 8090: echoes the first bytes, then says how its connection ended.
TCP_PEER = """
import socket
srv = socket.create_server(("0.0.0.0", 8090))
print("listening", flush=True)
c, _ = srv.accept()
c.sendall(c.recv(100))
try:
    while c.recv(65536):
        pass
    print("eof", flush=True)
except OSError as e:
    print(type(e).__name__, flush=True)
"""

# argv: ip. The plain pod's client of ip:8082, with a small receive buffer: most of the burst waits
# in its proxy. It reads once told to (a line on stdin), and says how many bytes came before the
# end, and how the connection ended.
BURST_CLIENT = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
s.settimeout(20)
s.connect((sys.argv[1], 8082))
print("connected", flush=True)
sys.stdin.readline()
n = 0
try:
    while chunk := s.recv(65536):
        n += len(chunk)
    print(n, "eof", flush=True)
except OSError as e:
    print(n, type(e).__name__, flush=True)
"""


class Output:
    """A process's output lines, read as they come."""

    def __init__(self, mesh: Mesh, args: list[str]) -> None:
        # Its stdin stays open until it is killed (a script may wait on it).
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        mesh.apps.append(self.proc)  # type: ignore[arg-type]
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def tell(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, line: str, timeout: float = 15.0) -> None:
        eventually(lambda: line in self.lines, lambda: f"{line!r} in {self.lines}", timeout=timeout)


def run_in(mesh: Mesh, pod: Pod, script: str, *args: str) -> Output:
    return Output(mesh, ["ip", "netns", "exec", pod.netns.name, sys.executable, "-c", script, *args])


def pooled_connections(lines: list[str], sa: str) -> dict[str, list[str]]:
    """What the fake HBONE server said of each connection from service account `sa`."""
    out: dict[str, list[str]] = {}
    for line in lines:
        who, _, what = line.partition(" ")
        if who.startswith(f"{sa}#"):
            out.setdefault(who, []).append(what)
    return out


def drain_seconds(log: str, uid: str) -> float:
    """From the manager's `pod deleted, stopping proxy` to the last worker's `connections drained`."""
    times = {}
    for line in log.splitlines():
        for key in ("stopping proxy", "connections drained"):
            if f"{key}: uid={uid}" in line:
                times[key] = datetime.datetime.fromisoformat(line.split("\t", 1)[0].replace("Z", "+00:00"))
    return (times["connections drained"] - times["stopping proxy"]).total_seconds()


def drained(metrics: str) -> dict[tuple[str, str], int]:
    """`ztunnel_pod_drain_connections_total` by (direction, outcome)."""
    out: dict[tuple[str, str], int] = {}
    for line in metrics.splitlines():
        if line.startswith("ztunnel_pod_drain_connections_total{"):
            labels = dict(p.split("=") for p in line[line.index("{") + 1 : line.index("}")].split(","))
            key = (labels["direction"].strip('"'), labels["outcome"].strip('"'))
            out[key] = out.get(key, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


def timed(action: Callable[[], list[CniResult]]) -> tuple[list[CniResult], float]:
    start = time.monotonic()
    result = action()
    return result, time.monotonic() - start


class Deleting:
    """A pod's CNI DEL, run in the background as the runtime does it while the test watches."""

    def __init__(self, node: Node, pod: Pod) -> None:
        self._done: list[tuple[list[CniResult], float]] = []
        self._thread = threading.Thread(target=lambda: self._done.append(timed(lambda: node.cni_del(pod))))
        self._thread.start()

    def join(self) -> tuple[list[CniResult], float]:
        self._thread.join(30)
        assert self._done, "CNI DEL did not return within 30 s"
        return self._done[0]


def test_deleting_a_pod_drains_its_connections_before_its_namespace_goes(mesh: Mesh) -> None:
    node = mesh.cluster.nodes[0]
    zt = start_node(mesh, node, mesh.xds)  # CONNECTION_TERMINATION_DEADLINE=2s
    server = node.add_pod("server", service_account="server")
    client = node.add_pod("client", service_account="client")
    fake = node.add_pod("fake", service_account="fake", enrolled=False)  # the test's HBONE server
    plain = node.add_pod("plain", enrolled=False)
    mesh.push("workloads:\n" + "".join(workload_yaml(p) for p in (server, client, fake)))
    mesh.wait_for_workloads(zt, [server, client])
    eventually(lambda: fake.uid in {w.get("uid") for w in zt.config_dump()["workloads"]}, "fake's workload")

    hbone_server = run_in(mesh, fake, FAKE_SERVER, f"spiffe://{TD}/ns/default/sa/fake")
    tcp_peer = run_in(mesh, plain, TCP_PEER)
    hbone_server.wait_for("listening")
    tcp_peer.wait_for("listening")
    # Out of the deleted pod: over HBONE through its pool to the fake server, plain TCP to `plain`.
    app = run_in(mesh, server, POD_APP, fake.ip, plain.ip)
    app.wait_for("ready")
    hbone_server.wait_for("delaying")  # the pod's last connection is still being set up
    # Into it: HBONE on its 15008 from the node, plaintext on its 15006 from `plain`.
    raw = Output(
        mesh,
        ["ip", "netns", "exec", node.ns.name, sys.executable, "-c", RAW_CLIENT, server.ip, f"spiffe://{TD}/ns/default/sa/client"],
    )  # fmt: skip
    raw.wait_for("held")
    burst = run_in(mesh, plain, BURST_CLIENT, server.ip)
    burst.wait_for("connected")
    app.wait_for("flushed")  # the burst has left the app: in flight, most of it held by its proxy
    # Another pod's connection to the same HBONE server, over its own pooled connection.
    bystander = hold(mesh, client, fake, 1)

    deleting = Deleting(node, server)
    # The drain has begun once the pod's listeners are gone; only now does the burst's client read.
    eventually(lambda: not PROXY_PORTS & listening_ports(server), "the deleted pod's listeners closed")
    burst.tell("read")
    hbone_server.tell("answer")  # the connection being set up is carried now, during the drain
    results, _ = deleting.join()
    assert all(r.ok for r in results), [str(r) for r in results]
    # Answered within the agent's 5 s (every connection closed within the 2 s deadline: below).
    assert "no WorkloadResponse" not in node.agent_output()

    # By the time DEL returned, each peer had seen the end, clean: nothing is left to time out.
    assert raw.lines[:3] == ["held", "goaway 0", "end_stream"] and raw.lines[3:] == ["eof"], raw.lines
    # Its pooled HBONE connections (one per worker that carried a stream): each stream's clean end,
    # then the GOAWAY and the close.
    pooled = pooled_connections(hbone_server.lines, "server")
    assert sorted(p for lines in pooled.values() for p in lines if p.startswith("end_stream")) == [
        "end_stream 8080",
        "end_stream 8081",
    ], hbone_server.lines
    for lines in pooled.values():
        assert lines[-2:] == ["goaway 0", "eof"], lines
        assert all(line.startswith("end_stream") for line in lines[:-2]), lines
    assert burst.lines == ["connected", f"{BURST} eof"], burst.lines
    assert tcp_peer.lines == ["listening", "eof"], tcp_peer.lines
    assert "slow echoed" in app.lines  # the late one was answered, then ended, gracefully

    # The other pod's connection and its pooled HBONE connection carry on.
    assert bystander.ping() == "y"
    assert not pooled_connections(hbone_server.lines, "client"), hbone_server.lines

    # Each connection's access-log line says why it ended; the metric counts them, all closed.
    log = zt.log()
    ended = [
        line
        for line in log.splitlines()
        if '"connection complete"' in line and 'reason="pod deleted"' in line
    ]
    assert len(ended) == 5, ended
    assert all("error=" not in line for line in ended), ended
    assert drained(zt.metrics_text()) == {("inbound", "closed"): 2, ("outbound", "closed"): 3}
    assert f"pod deleted, connections drained: uid={server.uid}" in log
    server.netns.delete()
    node.pods.remove(server)


# The deleted pod's app for the next test: a burst of BURST bytes to every client of 8082, held.
BURST_APP = f"""
import socket
srv = socket.create_server(("0.0.0.0", 8082))
print("listening", flush=True)
held = []
while True:
    c, _ = srv.accept()
    c.sendall(b"x" * {BURST})
    held.append(c)
"""

# argv: ip. A client of ip:8082 that reads to the end, says so, and then keeps its socket open.
STUBBORN_CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], 8082), timeout=20)
n = 0
while chunk := s.recv(65536):
    n += len(chunk)
    if n == 65536:
        print("received", flush=True)
print(n, "eof", flush=True)
sys.stdin.read()
"""


def test_a_peer_that_keeps_its_side_open_is_cut_within_what_the_agent_waits(mesh: Mesh) -> None:
    # A termination deadline longer than the agent waits for an answer: the pod's drain is bounded
    # below it (2.5 s), and the conversation with the agent goes on.
    node = mesh.cluster.nodes[0]
    zt = start_node(mesh, node, mesh.xds, CONNECTION_TERMINATION_DEADLINE="10s")
    server = node.add_pod("server", service_account="server")
    plain = node.add_pod("plain", enrolled=False)
    mesh.push("workloads:\n" + workload_yaml(server))
    mesh.wait_for_workloads(zt, [server])
    run_in(mesh, server, BURST_APP).wait_for("listening")
    client = run_in(mesh, plain, STUBBORN_CLIENT, server.ip)
    client.wait_for("received")

    results, took = timed(lambda: node.cni_del(server))
    assert all(r.ok for r in results), [str(r) for r in results]
    # It saw the end after the data, then was left open by its client until the deadline cut it.
    assert client.lines == ["received", f"{BURST} eof"], client.lines
    # The drain waited for the peer up to its deadline, 2.5 s (not the 10 s), then cut it.
    assert 2.4 < drain_seconds(zt.log(), server.uid) < 4.0, zt.log()
    assert 2.4 < took < 8.0, took
    assert drained(zt.metrics_text()) == {("inbound", "cut"): 1}
    [line] = [line for line in zt.log().splitlines() if 'reason="pod deleted"' in line]
    assert 'error="connection closed: drain deadline"' in line, line
    assert f"src.addr={plain.ip}:" in line and 'direction="inbound"' in line, line

    # The agent had its answer in time: same connection, and the next pod starts.
    assert "no WorkloadResponse" not in node.agent_output()
    assert "the node agent closed the connection" not in zt.log()
    late = node.add_pod("late", service_account="late")
    assert listening_ports(late) >= PROXY_PORTS
    server.netns.delete()
    node.pods.remove(server)
