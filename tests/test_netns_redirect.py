"""Real redirection, as root, in network namespaces the test creates.

Two hosts joined by a veth: host A (10.77.0.1) runs an app and its dedicated proxy; host B
(10.77.0.2) runs the server's proxy and an echo app. In A, `iptables -t nat ... REDIRECT --to-ports
15001` captures the app's connection; the proxy recovers the original destination with
SO_ORIGINAL_DST and carries it over HBONE to B. In B, plaintext arriving for the app is redirected
to 15006, where authorization without identity applies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Proxy
from tests.netns import Netns, link, require_root
from tests.procs import end_all
from tests.waiting import eventually

pytestmark = pytest.mark.root

A_IP, B_IP = "10.77.0.1", "10.77.0.2"

CONFIG = f"""
workloads:
  - uid: n//v1/Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client
    trustDomain: cluster.local
    workloadIps: ["{A_IP}"]
    protocol: HBONE
  - uid: n//v1/Pod/demo/server
    name: server
    namespace: demo
    serviceAccount: server
    trustDomain: cluster.local
    workloadIps: ["{B_IP}"]
    protocol: HBONE
policies:
  - name: strict-mtls
    namespace: demo
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - notPrincipals: [!Presence []]
"""

ECHO = textwrap.dedent(
    """
    import socket, sys, threading
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(64)
    def serve(c):
        peer = c.getpeername()[0].encode()
        while (d := c.recv(65536)):
            c.sendall(d)
        c.sendall(b"|peer=" + peer); c.close()
    while True:
        c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
    """
)

CLIENT = textwrap.dedent(
    """
    import socket, sys
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    c.sendall(b"hello"); c.shutdown(socket.SHUT_WR)
    data = b""
    try:
        while (d := c.recv(65536)):
            data += d
    except ConnectionResetError:
        pass
    print(data.decode())
    """
)

# Sends a payload the moment it is connected (before the proxy's CONNECT is answered), then waits
# for all of it back; prints the byte count and whether it came back unchanged.
BULK_CLIENT = textwrap.dedent(
    """
    import socket, sys
    payload = bytes(range(256)) * (int(sys.argv[3]) // 256)
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    c.sendall(payload); c.shutdown(socket.SHUT_WR)
    data = b""
    while (d := c.recv(65536)):
        data += d
    echoed = data[: len(payload)]
    print(len(payload), echoed == payload)
    """
)

MARKED_CLIENT = textwrap.dedent(
    """
    import socket, sys
    c = socket.socket(); c.settimeout(10)
    c.setsockopt(socket.SOL_SOCKET, 36, 1337)  # SO_MARK: bypasses A's capture rule, like a non-mesh app
    c.connect((sys.argv[1], int(sys.argv[2])))
    data = b""
    try:
        # The proxy closes before or after these arrive: either way nothing comes back, and no reset.
        # A connection held open instead is no denial: the timeout ends this script with an error.
        c.sendall(b"hello"); c.shutdown(socket.SHUT_WR)
        while (d := c.recv(65536)):
            data += d
    except OSError as e:
        print("error", type(e).__name__)
    print(repr(data.decode()))
    """
)


def proxy_env(name: str, config: Path, ip: str, **extra: str) -> dict[str, str]:
    env = dict(
        PROXY_MODE="dedicated",
        PROXY_WORKLOAD_INFO=f"demo/{name}/{name}",
        XDS_ADDRESS="",
        FAKE_CA="true",
        LOCAL_XDS_PATH=str(config),
        PACKET_MARK="1337",
        ADMIN_ADDRESS="127.0.0.1:15000",
        STATS_ADDRESS=f"{ip}:15020",
        READINESS_ADDRESS="127.0.0.1:15021",
    )
    env.update(extra)
    return env


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[Netns, Netns, Path]]:
    require_root("ip", "iptables", "curl")
    a, b = Netns("zta"), Netns("ztb")
    procs: list[subprocess.Popen[bytes]] = []
    proxies: list[Proxy] = []
    try:
        link(a, A_IP, b, B_IP)
        config = tmp_path / "mesh.yaml"
        config.write_text(CONFIG)
        (tmp_path / "echo.py").write_text(ECHO)
        (tmp_path / "client.py").write_text(CLIENT)
        (tmp_path / "marked_client.py").write_text(MARKED_CLIENT)
        (tmp_path / "bulk_client.py").write_text(BULK_CLIENT)
        # Host A: capture the app's outbound TCP (not to loopback, not from the proxy's marked sockets).
        a.exec(
            "iptables",
            "-t",
            "nat",
            "-A",
            "OUTPUT",
            "-p",
            "tcp",
            "!",
            "-d",
            "127.0.0.0/8",
            "-m",
            "mark",
            "!",
            "--mark",
            "1337",
            "-j",
            "REDIRECT",
            "--to-ports",
            "15001",
        )
        # Host B: plaintext for the app (anything but HBONE) goes to the inbound plaintext listener.
        b.exec(
            "iptables",
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-p",
            "tcp",
            "!",
            "--dport",
            "15008",
            "-j",
            "REDIRECT",
            "--to-ports",
            "15006",
        )
        procs.append(
            b.popen(
                [sys.executable, str(tmp_path / "echo.py"), B_IP, "8080"],
                dict(os.environ),
                str(tmp_path / "echo.log"),
            )
        )
        for ns, name, ip in ((a, "client", A_IP), (b, "server", B_IP)):
            proxies.append(Proxy(proxy_env(name, config, ip), tmp_path / f"{name}.log", netns=ns.name))
            proxies[-1].start(timeout=20)
        yield a, b, tmp_path
    finally:
        for proxy in proxies:
            proxy.stop()
        end_all(procs)
        a.delete()
        b.delete()


def series(ns: Netns, ip: str, name: str, *labels: str) -> list[str]:
    """The lines of metric `name` on the proxy at `ip` (scraped from inside `ns`) carrying every label."""
    metrics = ns.exec("curl", "-s", f"http://{ip}:15020/metrics").stdout.decode()
    return [
        line
        for line in metrics.splitlines()
        if line.startswith(name + "{") and all(label in line for label in labels)
    ]


def test_redirected_connection_goes_over_hbone(hosts: tuple[Netns, Netns, Path]) -> None:
    a, b, tmp = hosts
    out = a.exec(sys.executable, str(tmp / "client.py"), B_IP, "8080").stdout.decode().strip()
    # The echo reached B's app and came back through both proxies.
    logs = "\n".join((tmp / f"{n}.log").read_text() for n in ("client", "server"))
    assert out.startswith("hello|peer="), logs
    # The server proxy saw it as mTLS from the client's identity, for the original destination.
    opened = series(b, B_IP, "istio_tcp_connections_opened_total", 'reporter="destination"')
    assert len(opened) == 1, opened
    assert 'source_principal="spiffe://cluster.local/ns/demo/sa/client"' in opened[0]
    assert 'connection_security_policy="mutual_tls"' in opened[0]
    assert opened[0].endswith(" 1.0") or opened[0].endswith(" 1")
    # The client proxy learned the original destination from SO_ORIGINAL_DST (its access-log line is
    # written once the relay is over, which can be after the client saw the end).
    eventually(
        lambda: f"dst.hbone_addr={B_IP}:8080" in (tmp / "client.log").read_text(),
        lambda: f"the client proxy's access-log line: {(tmp / 'client.log').read_text()}",
    )
    log = (tmp / "client.log").read_text()
    assert f"dst.hbone_addr={B_IP}:8080" in log, log


def test_bytes_sent_before_the_tunnel_is_up_are_delivered_and_counted(
    hosts: tuple[Netns, Netns, Path],
) -> None:
    """What a client app sends at once goes out with the CONNECT (early data): it must still reach
    the app once, in order, and be counted by the client proxy as the relay's own bytes."""
    a, b, tmp = hosts
    size = 256 * 1024  # more than one read of the accepted socket, and than a stream's first window
    out = a.exec(sys.executable, str(tmp / "bulk_client.py"), B_IP, "8080", str(size)).stdout.decode()
    assert out.split() == [str(size), "True"], out
    # (The scrape of A's own proxy is captured too, as a connection to the client itself.)
    received = series(
        a, A_IP, "istio_tcp_received_bytes_total", 'reporter="source"', 'destination_workload="server"'
    )
    assert len(received) == 1, received
    assert float(received[0].rsplit(" ", 1)[1]) == size, received
    # The server proxy gave the app those bytes once: the early ones are not relayed again.
    delivered = series(b, B_IP, "istio_tcp_received_bytes_total", 'reporter="destination"')
    assert len(delivered) == 1, delivered
    assert float(delivered[0].rsplit(" ", 1)[1]) == size, delivered
    eventually(
        lambda: f"bytes_sent={size} " in (tmp / "client.log").read_text(),
        lambda: f"bytes_sent={size} in the client proxy's access log: {(tmp / 'client.log').read_text()}",
    )


def test_plaintext_inbound_is_denied_by_strict_policy(hosts: tuple[Netns, Netns, Path]) -> None:
    a, b, tmp = hosts
    out = a.exec(sys.executable, str(tmp / "marked_client.py"), B_IP, "8080").stdout.decode().strip()
    assert out == "''"  # closed without a byte, not reset: plaintext has no identity, STRICT denies it
    denial = "connection closed due to policy rejection: explicitly denied by: demo/strict-mtls"
    eventually(
        lambda: denial in (tmp / "server.log").read_text(),
        lambda: f"the denial in the server proxy's log: {(tmp / 'server.log').read_text()}",
    )
    log = (tmp / "server.log").read_text()
    assert "connection closed due to policy rejection: explicitly denied by: demo/strict-mtls" in log, log
    dump = json.loads(b.exec("curl", "-s", "http://127.0.0.1:15000/config_dump").stdout)
    assert [p["name"] for p in dump["policies"]] == ["strict-mtls"]
