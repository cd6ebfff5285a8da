"""A worker never goes deaf: a data-plane worker started through its shipped entry point
(`python -m ztunnel.workers.replacement`, as the supervisor starts a replacement), with this test as
its parent on the socket pair, is fed state images that cannot be read (a section table cut short,
sections cut short, a section of the wrong size, one misaligned) and a delta over a base it does not
hold. Each time it logs why, asks for the current images (`StateImageWanted`) and goes on: it still
carries connections by the images it holds, answers pings, and takes the next good image. A worker
of another build is refused at its start. And through `ztunnel proxy`: a worker out of descriptors
at a push keeps its connections, is sent the images again once, and follows the next push."""

from __future__ import annotations

import ctypes
import os
import resource
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from mesh.localconfig import parse_local_config
from tests.apps import echo_server, exchange, free_port, loopback_net, socks5, socks5_reply
from tests.harness import Fleet, proxy_env
from tests.waiting import eventually
from ztunnel.state.image import LAYOUT
from ztunnel.state.memfd import write_image
from ztunnel.state.replication import Replication
from ztunnel.state.store import ProxyState
from ztunnel.workers.channel import LAST, Reassembler, encode, recv_packet
from ztunnel.workers.messages import (
    CertificateReply,
    CertificateRequest,
    Failed,
    Ping,
    Pong,
    Ready,
    Spawn,
    StateImageReady,
    StateImageWanted,
    Stop,
    Synced,
    ToWorker,
)

pytestmark = pytest.mark.timeout(120)

NET = loopback_net()
PROXY, APP = f"{NET}.2", f"{NET}.3"
VIP = "10.97.0.1"
NOWHERE = free_port(APP)  # nothing listens there


def mesh(port: int, app_protocol: str = "TCP") -> str:
    """The proxy's workload, and a service whose VIP goes to the echo app on `port`."""
    return f"""
workloads:
  - uid: x//v1/Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client
    workloadIps: ["{PROXY}"]
    protocol: HBONE
  - uid: x//v1/Pod/demo/app
    name: app
    namespace: demo
    serviceAccount: app
    workloadIps: ["{APP}"]
    protocol: {app_protocol}
    services: {{"demo/app.demo.svc.cluster.local": {{"80": {port}}}}}
services:
  - name: app
    namespace: demo
    hostname: app.demo.svc.cluster.local
    vips: ["/{VIP}"]
    ports: {{"80": {port}}}
"""


class Parent:
    """This test as a worker's parent: its end of the socket pair, and the store it replicates."""

    def __init__(self, log: Path, env: dict[str, str]) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = log
        self.images: list[tuple[StateImageReady, list[int]]] = []
        self.store = ProxyState()
        self.replication = Replication(self.store, self._published)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ztunnel.workers.replacement",
                    "0",
                    str(theirs.fileno()),
                    str(os.getpid()),
                ],
                env={**os.environ, **env},
                pass_fds=(theirs.fileno(),),
                stdout=out,
                stderr=out,
            )
        theirs.close()
        self._reassembler = Reassembler()

    def _published(self, message: ToWorker, fds: Sequence[int]) -> None:
        if isinstance(message, StateImageReady):
            self.images.append((message, [os.dup(fd) for fd in fds]))

    def send(self, message: ToWorker, fds: Sequence[int] = ()) -> None:
        packets = encode(message)
        for i, packet in enumerate(packets):
            socket.send_fds(self.sock, [packet], list(fds) if i == len(packets) - 1 else [])

    def send_images(self) -> None:
        for message, fds in self.replication.images():
            self.send(message, fds)

    def expect(self, kind: type, timeout: float = 60.0) -> object:
        """The worker's next message of `kind` (a certificate request is answered, unless it is what
        is expected: no CA here)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([self.sock], [], [], left)[0]:
                break
            data, fds, _ = recv_packet(self.sock)
            for fd in fds:
                os.close(fd)
            assert data, f"the worker hung up: {self.logs()}"
            done, message = self._reassembler.feed(data)
            if isinstance(message, CertificateRequest) and kind is not CertificateRequest:
                self.send(CertificateReply(message.identity, None, "no CA in this test"))
            elif done and isinstance(message, kind):
                return message
        raise AssertionError(f"no {kind.__name__} from the worker in {timeout}s: {self.logs()}")

    def hears(self) -> None:
        self.send(Ping())
        self.expect(Pong)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send(Stop(0.0))
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.sock.close()
        self.replication.close()
        for _, fds in self.images:
            for fd in fds:
                os.close(fd)


@pytest.fixture(name="parent")
def parent_fixture(tmp_path: Path) -> Iterator[Parent]:
    with echo_server(APP, 8080):
        parent = Parent(tmp_path / "worker.log", proxy_env(PROXY))
        try:
            yield parent
        finally:
            parent.close()


def carried(payload: bytes) -> bool:
    with socks5(PROXY, VIP, 80) as s:
        return exchange(s, payload) == payload


def reached() -> bool:
    s, code = socks5_reply(PROXY, VIP, 80)
    with s:
        return code == 0 and exchange(s, b"x") == b"x"


def sealed(data: bytes) -> tuple[int, int]:
    return write_image([data])


def section_table(image: bytes) -> list[tuple[int, int]]:
    _, _, count = struct.unpack_from("<8sII", image)
    return [struct.unpack_from("<QQ", image, 16 + 16 * i) for i in range(count)]


def with_table(image: bytes, table: list[tuple[int, int]]) -> bytes:
    head = image[:16] + b"".join(struct.pack("<QQ", o, n) for o, n in table)
    return head + image[len(head) :]


def test_a_worker_fed_images_it_cannot_take_keeps_serving_and_asks_for_the_current_ones(
    parent: Parent,
) -> None:
    parent.send(Spawn(0, LAYOUT))
    parent.store.apply_local_config(parse_local_config(mesh(8080)))
    parent.send_images()
    parent.send(Synced())
    parent.expect(Ready)
    assert carried(b"through the first image")

    good = b"".join(parent.store.image())
    table = section_table(good)
    wrong_size = list(table)
    wrong_size[1] = (table[1][0], table[1][1] - 4)  # the workloads' offsets: not whole 8-byte items
    shifted = [(o + 4, n) for o, n in table]  # every section 4 bytes off its alignment
    cut_body = good[: table[-1][0]]
    bad = {
        "a section table cut short": good[:40],
        "sections cut short": cut_body,
        "a section of the wrong size": with_table(good, wrong_size),
        "misaligned sections": with_table(good, shifted)[: table[0][0]] + b"\0" * 4 + good[table[0][0] :],
    }
    generation = 100
    for what, data in bad.items():
        generation += 1
        fd, size = sealed(data)
        try:
            parent.send(StateImageReady(size, generation), [fd])
        finally:
            os.close(fd)
        wanted = parent.expect(StateImageWanted)
        assert isinstance(wanted, StateImageWanted) and wanted.refused == generation, what
        eventually(lambda g=generation: f"state image {g} refused" in parent.logs(), f"the refusal of {what}")
        parent.hears()
        assert carried(what.encode()), what

    # A delta over a base this worker never got: refused whole, the current images asked for.
    parent.store.apply_local_config(parse_local_config(mesh(NOWHERE)))  # a new base (the worker gets none)
    parent.store.upsert_service(parent.store.services()[0])  # and a delta over it
    delta, fds = parent.images[-1]
    assert delta.base is not None
    parent.send(delta, fds)
    wanted = parent.expect(StateImageWanted)
    assert isinstance(wanted, StateImageWanted) and wanted.refused == delta.generation
    assert f"a delta over base {delta.base}" in wanted.reason
    parent.hears()
    with socks5(PROXY, VIP, 80) as s:
        assert exchange(s, b"still the old port") == b"still the old port"

    parent.send_images()  # what the supervisor sends when asked: the current base, then its delta
    parent.hears()
    eventually(lambda: not reached(), "the worker follows the new images (the VIP to a closed port)")
    assert "Traceback" not in parent.logs()
    assert parent.proc.poll() is None


def test_a_certificate_reply_lost_on_the_way_is_asked_again_and_the_worker_goes_on(
    parent: Parent,
) -> None:
    """The reply to the worker's certificate request (its workload's, fetched before it serves) does
    not unpickle: the worker asks again rather than wait for it forever, takes the second reply (the
    CA failed), serves, and refuses the connection that needs the certificate instead of hanging."""
    parent.send(Spawn(0, LAYOUT))
    parent.store.apply_local_config(parse_local_config(mesh(8080, app_protocol="HBONE")))
    parent.send_images()
    parent.send(Synced())
    request = parent.expect(CertificateRequest)
    assert isinstance(request, CertificateRequest)
    parent.sock.send(LAST + b"not a pickle")  # its reply, lost on the way
    again = parent.expect(CertificateRequest, timeout=30)
    assert isinstance(again, CertificateRequest) and again.identity == request.identity
    parent.send(CertificateReply(again.identity, None, "no CA in this test"))
    parent.expect(Ready)
    eventually(lambda: "a message from the parent was lost" in parent.logs(), "the lost reply logged")
    # The app's HBONE port accepts (no TLS behind it): the connection gets as far as its certificate.
    with socket.create_server((APP, 15008)):
        s, code = socks5_reply(PROXY, VIP, 80)
        s.close()
    assert code != 0
    parent.hears()
    assert "Traceback" not in parent.logs()


def test_a_worker_of_another_build_is_refused_at_its_start(parent: Parent) -> None:
    parent.send(Spawn(0, LAYOUT ^ 1))  # the parent writes images of another record layout
    failed = parent.expect(Failed)
    assert isinstance(failed, Failed) and "another build" in failed.error, failed
    assert f"{LAYOUT ^ 1:08x}" in failed.error
    assert parent.proc.wait(10) == 1
    with pytest.raises(OSError):
        socket.create_connection((PROXY, 15080), timeout=2).close()  # it never bound


def test_a_worker_out_of_descriptors_when_an_image_comes_loses_the_image_not_its_parent(
    parent: Parent,
) -> None:
    parent.send(Spawn(0, LAYOUT))
    parent.store.apply_local_config(parse_local_config(mesh(8080)))
    parent.send_images()
    parent.send(Synced())
    parent.expect(Ready)
    held = socks5(PROXY, VIP, 80)
    pid = parent.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    open_fds = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    lowest_free = min(set(range(len(open_fds) + 1)) - open_fds)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free, hard))  # no descriptor left to take
    try:
        parent.store.apply_local_config(parse_local_config(mesh(NOWHERE)))  # a new base: its memfd is lost
        base, fds = parent.images[-1]
        parent.send(base, fds)
        wanted = parent.expect(StateImageWanted)
        assert isinstance(wanted, StateImageWanted) and wanted.refused == base.generation
        eventually(lambda: "file descriptors were lost" in parent.logs(), "the lost descriptor logged")
        parent.hears()
        assert parent.proc.poll() is None  # the parent is not taken for gone
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    with held:
        assert exchange(held, b"the connection held through it") == b"the connection held through it"
    parent.send_images()  # as the supervisor answers StateImageWanted
    eventually(lambda: not reached(), "the worker follows the images sent again")
    assert "Traceback" not in parent.logs()


def test_a_proxys_worker_out_of_descriptors_at_a_push_keeps_serving_and_follows_the_next(
    tmp_path: Path, fleet: Fleet
) -> None:
    """Through `ztunnel proxy` and the development control plane: the supervisor sends a worker
    that lost an image's fd the current images again, once, and the next push reaches it."""
    with echo_server(APP, 8080):
        cp = fleet.control_plane(tmp_path / "cp", f"{NET}.10", mesh(8080))
        (proxy,) = fleet.start_all(cp.wire(proxy_env(PROXY, INSTANCE_IP=PROXY)))
        eventually(lambda: reached(), "the VIP routed")
        worker = proxy.workers()[0]
        held = [socks5(PROXY, VIP, 80) for _ in range(8)]  # some in each worker
        soft, hard = resource.prlimit(worker, resource.RLIMIT_NOFILE)
        open_fds = {int(fd) for fd in os.listdir(f"/proc/{worker}/fd")}
        resource.prlimit(
            worker, resource.RLIMIT_NOFILE, (min(set(range(len(open_fds) + 1)) - open_fds), hard)
        )
        try:
            cp.push(mesh(NOWHERE))
            eventually(
                lambda: "sending it the current images again" in proxy.log(),
                "the images sent again",
                timeout=60,
            )
            eventually(lambda: "cannot take state image" in proxy.log(), "no loop of resends", timeout=60)
            assert worker in proxy.workers()
        finally:
            resource.prlimit(worker, resource.RLIMIT_NOFILE, (soft, hard))
        for s in held:
            with s:
                assert exchange(s, b"held") == b"held"
        cp.push(mesh(free_port(APP)))  # the next push: a delta over the base the worker holds
        eventually(
            lambda: not any(reached() for _ in range(8)), "every worker follows the next push", timeout=60
        )
        assert worker in proxy.workers() and "Traceback" not in proxy.log()


PIDFD_GETFD = 438  # the syscall's number (the same on every architecture since 5.6)


def worker_channel_end(pid: int) -> socket.socket:
    """A copy of the worker's own end of its channel to the parent, taken from the running process."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    continue
            except FileNotFoundError:
                continue
            fd = libc.syscall(PIDFD_GETFD, pidfd, int(name), 0)
            assert fd >= 0, os.strerror(ctypes.get_errno())
            sock = socket.socket(fileno=fd)
            if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_SEQPACKET:
                return sock
            sock.close()
    finally:
        os.close(pidfd)
    raise AssertionError(f"no channel socket in worker {pid}")


def test_a_message_from_a_worker_that_cannot_be_read_is_lost_alone_not_the_worker(
    tmp_path: Path, fleet: Fleet
) -> None:
    """Through `ztunnel proxy`: a packet that does not unpickle, and one without a header, arrive at
    the parent from a worker (written on the worker's end of its channel). The parent logs each and
    reads on: the worker is not taken for gone, keeps its connections, and follows the next push."""
    with echo_server(APP, 8080):
        cp = fleet.control_plane(tmp_path / "cp", f"{NET}.10", mesh(8080))
        (proxy,) = fleet.start_all(cp.wire(proxy_env(PROXY, INSTANCE_IP=PROXY)))
        eventually(lambda: reached(), "the VIP routed")
        workers = proxy.workers()
        held = [socks5(PROXY, VIP, 80) for _ in range(8)]  # some in each worker
        with worker_channel_end(workers[0]) as end:
            end.send(LAST + b"not a pickle")
            end.send(b"\x07no header")
        eventually(
            lambda: proxy.log().count("a message from it was lost") >= 2,
            "the lost messages logged",
            timeout=60,
        )
        for s in held:
            with s:
                assert exchange(s, b"held") == b"held"
        cp.push(mesh(free_port(APP)))
        eventually(
            lambda: not any(reached() for _ in range(8)), "every worker follows the next push", timeout=60
        )
        assert proxy.workers() == workers and "Traceback" not in proxy.log()
