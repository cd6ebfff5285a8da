"""The ZDS codec and ztunnel's ZDS state machine fed mutated and random packets, with real fds over a
real SOCK_SEQPACKET pair: every packet gets a reply that is a WorkloadResponse with an ack (or, for
an Add it starts, a StartProxy that owns the fd), every fd is either handed over or closed, and
nothing but a `ZdsError` comes out of the codec."""

from __future__ import annotations

import os
import socket

from hypothesis import given
from hypothesis import strategies as st

from xds import zds
from ztunnel.inpod.protocol import StartProxy, ZdsStateMachine

TEXT = st.text(max_size=12)
VALID = st.one_of(
    st.builds(zds.add, TEXT, TEXT, TEXT, TEXT),
    st.builds(zds.keep, TEXT),
    st.builds(zds.delete, TEXT),
    st.just(zds.snapshot_sent()),
    st.just(zds.hello()),
    st.builds(zds.ack, TEXT),
)


@st.composite
def packets(draw: st.DrawFn) -> tuple[bytes, int]:
    data = bytearray(draw(st.one_of(VALID, st.binary(max_size=64))))
    for _ in range(draw(st.integers(0, 3))):
        if data and draw(st.booleans()):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    if data and draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data), draw(st.sampled_from([0, 1, 1, 2, 3]))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@given(st.lists(packets(), min_size=1, max_size=8))
def test_packets_get_replies_and_no_fd_leaks(sequence: list[tuple[bytes, int]]) -> None:
    before = _open_fds()
    machine = ZdsStateMachine()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        for data, n_fds in sequence:
            fds = [os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC) for _ in range(n_fds)]
            try:
                zds.send_packet(a, data or b"\x00", fds)  # an empty packet would read as the end
            finally:
                zds.close_fds(fds)
            got = zds.recv_packet(b)
            assert got is not None
            step = machine.receive(*got)
            for action in step.actions:
                if isinstance(action, StartProxy):  # the manager owns the fd now
                    os.close(action.netns_fd)
                    assert step.reply is None
                    machine.started(action.pod.uid, action.netns_key)
            if step.reply is not None:
                assert zds.decode_response(step.reply).ack.error == step.error
    finally:
        a.close()
        b.close()
    assert _open_fds() == before


@given(st.binary(max_size=2 * zds.MAX_PACKET))
def test_decoders_raise_only_zds_errors(data: bytes) -> None:
    for decode in (zds.decode_request, zds.decode_response, zds.decode_hello):
        try:
            decode(data)
        except zds.ZdsError:
            pass


def test_oversized_packets_are_refused_and_their_fds_closed() -> None:
    before = _open_fds()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            zds.send_packet(a, b"x" * (zds.MAX_PACKET + 1))
        except zds.ZdsError as e:
            assert "exceeds" in str(e)
        else:
            raise AssertionError("an oversized packet was sent")
        a.sendmsg(
            [b"x" * (zds.MAX_PACKET + 1)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, "little"))]
        )
        try:
            zds.recv_packet(b)
        except zds.ZdsError as e:
            assert "truncated" in str(e)
        else:
            raise AssertionError("a truncated packet was read")
    finally:
        os.close(fd)
        a.close()
        b.close()
    assert _open_fds() == before
