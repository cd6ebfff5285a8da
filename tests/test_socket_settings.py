"""Settings that act on the proxy's sockets: USER_TIMEOUT_ENABLED and IPV6_ENABLED.

The socket-level tests read the options back from real sockets; the root test runs `ztunnel proxy`
in a fresh network namespace and reads its listeners with `ss`, as an operator would."""

from __future__ import annotations

import asyncio
import socket
import sys
import textwrap
from collections.abc import Iterator

import pytest

from tests.harness import Fleet
from tests.netns import Netns, require_root
from tests.waiting import eventually
from ztunnel.config.settings import Config
from ztunnel.sockets import SocketFactory, SocketOptions, user_timeout_ms


def test_user_timeout_is_keepalive_time_plus_retries_times_interval() -> None:
    on = Config.from_env(
        {
            "USER_TIMEOUT_ENABLED": "true",
            "KEEPALIVE_TIME": "10s",
            "KEEPALIVE_INTERVAL": "2s",
            "KEEPALIVE_RETRIES": "3",
        },
        mesh_config_path=None,
    )
    assert user_timeout_ms(on) == 16_000
    assert user_timeout_ms(Config.from_env({}, mesh_config_path=None)) is None


async def test_user_timeout_and_keepalive_on_outgoing_and_accepted_sockets() -> None:
    factory = SocketFactory(SocketOptions(user_timeout_ms=16_000))
    plain = SocketFactory(SocketOptions())
    accepted: asyncio.Queue[socket.socket] = asyncio.Queue()
    listener = factory.listener("127.0.0.1", 0)
    loop = asyncio.get_running_loop()

    async def accept() -> None:
        sock, _ = await loop.sock_accept(listener)
        await accepted.put(sock)

    task = loop.create_task(accept())
    out = await factory.connect(listener.getsockname())
    other = await plain.connect(listener.getsockname())
    inside = await asyncio.wait_for(accepted.get(), 5)
    try:
        assert out.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 16_000
        assert inside.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 16_000
        assert other.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0  # the kernel default
        # The accepted socket has the listener's options, as the kernel copies them to each child.
        assert inside.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert inside.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 180
        assert inside.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        task.cancel()
        for s in (out, other, inside, listener):
            s.close()


def test_wildcard_listener_is_ipv4_only_without_ipv6() -> None:
    v4 = SocketFactory(SocketOptions(ipv6=False)).listener("", 0)
    dual = SocketFactory(SocketOptions()).listener("", 0)
    try:
        assert (v4.family, v4.getsockname()[0]) == (socket.AF_INET, "0.0.0.0")
        assert (dual.family, dual.getsockname()[0]) == (socket.AF_INET6, "::")
        with socket.create_connection(("127.0.0.1", v4.getsockname()[1]), timeout=5):
            pass
        if socket.has_ipv6:
            with pytest.raises(OSError):
                socket.create_connection(("::1", v4.getsockname()[1]), timeout=5).close()
    finally:
        v4.close()
        dual.close()


LOCAL = textwrap.dedent(
    """
    workloads:
      - uid: t//v1/Pod/demo/app
        name: app
        namespace: demo
        serviceAccount: app
        trustDomain: cluster.local
        workloadIps: ["10.9.0.2"]
        protocol: HBONE
    """
)


@pytest.fixture
def netns() -> Iterator[Netns]:
    require_root("ip", "ss")
    ns = Netns("v6off")
    try:
        yield ns
    finally:
        ns.delete()


@pytest.mark.root
@pytest.mark.parametrize(("ipv6", "wildcard"), [("false", "0.0.0.0"), ("true", "*")])
def test_proxy_binds_the_wildcard_of_ipv6_enabled(
    netns: Netns, ipv6: str, wildcard: str, fleet: Fleet
) -> None:
    env = {
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": "demo/app/app",
        "XDS_ADDRESS": "",
        "FAKE_CA": "true",
        "LOCAL_XDS": LOCAL,
        "IPV6_ENABLED": ipv6,
        "ADMIN_ADDRESS": "127.0.0.1:15000",
    }
    proxy = fleet.proxy(env, netns=netns.name)
    proxy.spawn()

    def listening() -> set[str]:
        out = netns.exec("ss", "-ltnH").stdout.decode()
        return {line.split()[3] for line in out.splitlines() if line.strip()}

    eventually(
        lambda: f"{wildcard}:15008" in listening() or not proxy.running(),
        lambda: f"{wildcard}:15008 in {listening()}; log: {proxy.tail(2000)}",
    )
    assert proxy.running(), proxy.log()
    bound = listening()
    for port in (15001, 15006, 15008):
        assert f"{wildcard}:{port}" in bound, bound
    if ipv6 == "false":
        assert not any(addr.startswith("[::]") or addr.startswith("*") for addr in bound), bound
    proxy.stop()


async def test_connect_to_a_closed_port_is_refused() -> None:
    """The dialler connects without a resolver round trip; a refusal still reads as asyncio's."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(ConnectionRefusedError) as e:
        await SocketFactory(SocketOptions()).connect(("127.0.0.1", port))
    assert str(e.value) == f"[Errno 111] Connect call failed ('127.0.0.1', {port})"


async def test_connect_that_gets_no_answer_times_out() -> None:
    """A listener whose accept queue is full drops new SYNs: the dial gives up at its timeout."""
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    addr = full.getsockname()
    factory = SocketFactory(SocketOptions())
    queued = []
    try:
        while True:  # fill the queue (its length is the kernel's business: until a dial hangs)
            try:
                queued.append(await factory.connect(addr, timeout=0.5))
            except TimeoutError:
                break
            assert len(queued) < 10
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            await factory.connect(addr, timeout=0.3)
        assert 0.25 < loop.time() - start < 2
    finally:
        for s in (full, *queued):
            s.close()


_TIME_WAIT_PROBE = textwrap.dedent(
    """
    import asyncio, errno, socket, sys
    from ztunnel.sockets import SocketFactory, SocketOptions

    async def main():
        srv = socket.socket()
        srv.bind(("127.0.0.1", 7000))
        srv.listen(64)
        srv.setblocking(False)
        loop = asyncio.get_running_loop()

        async def close_after_client():  # the client closes first: its side goes to TIME_WAIT
            conn, _ = await loop.sock_accept(srv)
            conn.setblocking(False)
            await loop.sock_recv(conn, 1)
            conn.close()

        async def one(sock):
            task = asyncio.ensure_future(close_after_client())
            sock.close()
            await task

        for _ in range(8):  # the kernel's ephemeral range, 8 ports: all in TIME_WAIT afterwards
            s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, ("127.0.0.1", 7000))
            await one(s)
        s = socket.socket()
        print("kernel:", errno.errorcode.get(s.connect_ex(("127.0.0.1", 7000)), "ok"))
        s.close()
        factory = SocketFactory(SocketOptions(source_ports=(40100, 40107)))
        for _ in range(24):  # three times round 8 ports of its own, every one in TIME_WAIT
            await one(await factory.connect(("127.0.0.1", 7000), timeout=5))
        print("factory: 24 connected")

    asyncio.run(main())
    """
)


def test_outgoing_connections_reuse_time_wait_ports(netns: Netns) -> None:
    """Where every ephemeral port has a TIME_WAIT socket to the destination, the kernel refuses a
    new connection (it searched them all); the dialler's ports, taken in turn and bound explicitly,
    reuse their own TIME_WAIT address pairs and keep connecting."""
    netns.exec("sysctl", "-qw", "net.ipv4.tcp_tw_reuse=0")
    netns.exec("sysctl", "-qw", "net.ipv4.ip_local_port_range=40000 40007")
    out = netns.exec(sys.executable, "-c", _TIME_WAIT_PROBE, check=False)
    text = (out.stdout + out.stderr).decode()
    assert out.returncode == 0, text
    assert text.splitlines() == ["kernel: EADDRNOTAVAIL", "factory: 24 connected"], text
