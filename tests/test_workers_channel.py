"""The worker channel's framing as transcripts (packets in, messages out), and the channel over a
real socket pair in this process (no child processes, no sleeps)."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket

import pytest

from ztunnel.workers.channel import (
    CHUNK,
    LAST,
    MORE,
    Channel,
    ChannelError,
    MessageLost,
    Reassembler,
    encode,
)
from ztunnel.workers.messages import Counters, Scrape


def test_a_small_message_is_one_last_packet() -> None:
    packets = encode(Scrape(7))
    assert len(packets) == 1 and packets[0][:1] == LAST
    assert Reassembler().feed(packets[0]) == (True, Scrape(7))


def test_a_large_message_comes_in_chunks_and_whole_out_of_the_last() -> None:
    message = Counters(
        3, {"istio_tcp_connections_opened": {"samples": [[f"x{i}", [], float(i)] for i in range(30_000)]}}
    )
    packets = encode(message)
    size = len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    assert len(packets) == -(-size // CHUNK) > 1
    assert [p[:1] for p in packets] == [MORE] * (len(packets) - 1) + [LAST]
    assert all(len(p) <= CHUNK + 1 for p in packets)
    r = Reassembler()
    results = [r.feed(p) for p in packets]
    assert results[:-1] == [(False, None)] * (len(packets) - 1)
    assert results[-1] == (True, message)
    assert not r.partial


def test_a_packet_without_a_header_is_an_error_and_the_partial_message_is_dropped() -> None:
    message = Counters(1, {"f": {"samples": [[f"x{i}", [], float(i)] for i in range(30_000)]}})
    first, *_ = encode(message)
    r = Reassembler()
    r.feed(first)
    assert r.partial
    with pytest.raises(ChannelError, match="bad packet header"):
        r.feed(b"\x07junk")
    assert not r.partial
    assert r.feed(encode(Scrape(2))[0]) == (True, Scrape(2))  # the next message is whole again


def test_the_channel_carries_a_large_message_and_its_fd_then_says_the_peer_is_gone() -> None:
    async def main() -> None:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        left, right = Channel(a), Channel(b)
        r, w = os.pipe()
        big = Counters(9, {"f": {"samples": [[f"x{i}", [], float(i)] for i in range(30_000)]}})
        try:
            send = asyncio.ensure_future(left.send(big, [w]))
            got = await right.recv()
            await send
            assert got is not None
            message, fds = got
            assert message == big and len(fds) == 1
            os.write(fds[0], b"through the passed fd")
            os.close(fds[0])
            assert os.read(r, 100) == b"through the passed fd"
            await left.send(Scrape(10))
            assert await right.recv() == (Scrape(10), [])
            left.close()
            assert await right.recv() is None
        finally:
            right.close()
            os.close(r)
            os.close(w)

    asyncio.run(main())


def test_a_truncated_packet_is_an_error_not_a_message() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    async def main() -> None:
        a.send(LAST + b"x" * (CHUNK + 10))  # longer than any packet of ours
        with pytest.raises(ChannelError, match="truncated"):
            await Channel(b).recv()

    try:
        asyncio.run(main())
    finally:
        a.close()
        b.close()


def test_a_message_that_does_not_unpickle_is_lost_alone() -> None:
    r = Reassembler()
    with pytest.raises(MessageLost, match="does not unpickle"):
        r.feed(LAST + b"\x80\x05not a pickle")
    assert not r.partial
    assert r.feed(encode(Scrape(3))[0]) == (True, Scrape(3))  # the next message is read as usual
