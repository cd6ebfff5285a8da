"""h2 as the oracle of our HTTP/2 core: the same generated exchanges run between h2 and h2, our
core as client against an h2 server, and an h2 client against our core as server, all in memory;
every pairing must observe the same requests, responses, bytes, ends, resets and GOAWAY.

The exchanges are valid HTTP/2: up to eight CONNECT streams, payloads larger than the windows
(receivers that hold their acknowledgements until told, so windows run dry and refill), resets
from either side, a GOAWAY from the server while streams are open, request header blocks larger
than a frame (sent as HEADERS and CONTINUATIONs), padded DATA (h2 pads; our core never does),
PINGs, and every byte stream cut into reads at random points.

Resets happen once the connection is quiet, so what each side received before is deterministic.
h2 ends its connection state on any GOAWAY, sent or received, so an exchange stops at the GOAWAY
(the streams finishing below its last stream id are our core's own transcripts' concern).

The budget is `FUZZ_EXAMPLES` examples (a bounded, derandomised default under `make test`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import h2.events as h2ev
from h2.config import H2Configuration
from h2.connection import H2Connection
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hbone.h2core import H2Core
from hbone.h2core import events as ev
from hbone.settings import H2Settings

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=max(EXAMPLES // 3, 20),  # each example runs three pairings
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize="FUZZ_EXAMPLES" not in os.environ,
)
# Our core with h2's defaults for what a peer sends within, so windows and frames are small.
OURS = H2Settings(stream_window=65535, connection_window=65535, frame_size=16384)
BIG_VALUE = 20_000  # a request field this long takes a header block past one 16 KiB frame


@dataclass
class Seen:
    """What one endpoint observed of one stream."""

    headers: list[tuple[str, str]] | None = None
    status: int | None = None
    data: bytearray = field(default_factory=bytearray)
    ended: bool = False
    reset: int | None = None


class Endpoint:
    """One side of a pairing: our core or h2, behind one interface; it acknowledges what it
    receives at once unless holding, and keeps what the windows do not take yet."""

    def __init__(self, client_side: bool) -> None:
        self.client_side = client_side
        self.seen: dict[int, Seen] = {}
        self.goaway: tuple[int, int] | None = None  # (error code, last stream id)
        self.pongs = 0
        self.holding = False
        self.held: list[tuple[int, int]] = []
        self.pending: dict[int, tuple[bytearray, bool, int]] = {}  # data, END after it, padding

    def stream(self, sid: int) -> Seen:
        return self.seen.setdefault(sid, Seen())

    def received(self, sid: int, data: bytes, flow: int) -> None:
        self.stream(sid).data += data
        if self.holding:
            self.held.append((sid, flow))
        else:
            self.ack(sid, flow)

    def release(self) -> None:
        held, self.held = self.held, []
        for sid, n in held:
            self.ack(sid, n)

    def queue(self, sid: int, data: bytes, end: bool, pad: int) -> None:
        buf, _, _ = self.pending.get(sid, (bytearray(), False, 0))
        self.pending[sid] = (buf + data, end, pad)
        self.flush_pending()

    def flush_pending(self) -> None:
        for sid, (buf, end, pad) in list(self.pending.items()):
            while buf:
                n = self.send(sid, bytes(buf), pad)
                if not n:
                    break
                del buf[:n]
            if not buf:
                del self.pending[sid]
                if end:
                    self.end(sid)

    def idle(self) -> bool:
        return not self.pending

    # -- what each implementation provides --
    def receive(self, data: bytes) -> None: ...
    def output(self) -> bytes: ...
    def open(self, headers: list[tuple[str, str]]) -> int: ...
    def respond(self, sid: int) -> None: ...
    def send(self, sid: int, data: bytes, pad: int) -> int: ...
    def end(self, sid: int) -> None: ...
    def reset(self, sid: int, code: int) -> None: ...
    def ack(self, sid: int, n: int) -> None: ...
    def goaway_now(self) -> None: ...
    def ping(self) -> None: ...


class Ours(Endpoint):
    def __init__(self, client_side: bool) -> None:
        super().__init__(client_side)
        self.core = H2Core(client_side=client_side, settings=OURS, now=0.0)
        self.core.initiate(OURS.local_settings(client_side=client_side), 0.0)

    def receive(self, data: bytes) -> None:
        for e in self.core.receive(data, 0.0):
            if isinstance(e, (ev.RequestReceived, ev.ResponseReceived)):
                seen = self.stream(e.stream_id)
                if isinstance(e, ev.RequestReceived):
                    seen.headers = e.headers
                else:
                    seen.status = int(dict(e.headers)[":status"])
            elif isinstance(e, ev.DataReceived):
                self.received(e.stream_id, e.data, e.flow_length)
            elif isinstance(e, ev.StreamEnded):
                self.stream(e.stream_id).ended = True
            elif isinstance(e, ev.StreamReset):
                assert e.by_peer, f"our core reset a valid stream: {e}"
                self.stream(e.stream_id).reset = e.error_code
            elif isinstance(e, ev.GoAwayReceived):
                self.goaway = (e.error_code, e.last_stream_id)
            elif isinstance(e, ev.PingAcked):
                self.pongs += 1
            elif isinstance(e, ev.ConnectionTerminated):
                raise AssertionError(f"our core ended a valid exchange: {e}")
            elif isinstance(e, ev.WindowUpdated):
                self.flush_pending()

    def output(self) -> bytes:
        return b"".join(bytes(c) for c in self.core.take_output())

    def open(self, headers: list[tuple[str, str]]) -> int:
        return self.core.open_stream(headers)

    def respond(self, sid: int) -> None:
        assert self.core.send_headers(sid, [(":status", "200")], end_stream=False)

    def send(self, sid: int, data: bytes, pad: int) -> int:
        return self.core.send_data(sid, data)

    def end(self, sid: int) -> None:
        self.core.end_stream(sid)

    def reset(self, sid: int, code: int) -> None:
        self.core.reset_stream(sid, code)

    def ack(self, sid: int, n: int) -> None:
        self.core.ack(sid, n)

    def goaway_now(self) -> None:
        self.core.goaway()

    def ping(self) -> None:
        self.core.ping(b"12345678")


class H2(Endpoint):
    def __init__(self, client_side: bool) -> None:
        super().__init__(client_side)
        self.conn = H2Connection(H2Configuration(client_side=client_side, header_encoding=None))
        self.conn.initiate_connection()

    def receive(self, data: bytes) -> None:
        for e in self.conn.receive_data(data):
            if isinstance(e, h2ev.RequestReceived):
                self.stream(e.stream_id).headers = [(k.decode(), v.decode()) for k, v in e.headers]  # type: ignore[union-attr]
            elif isinstance(e, h2ev.ResponseReceived):
                self.stream(e.stream_id).status = int(dict(e.headers)[b":status"])  # type: ignore[arg-type]
            elif isinstance(e, h2ev.DataReceived):
                self.received(e.stream_id, e.data, e.flow_controlled_length)  # type: ignore[arg-type]
            elif isinstance(e, h2ev.StreamEnded):
                self.stream(e.stream_id).ended = True  # type: ignore[arg-type]
            elif isinstance(e, h2ev.StreamReset):
                self.stream(e.stream_id).reset = int(e.error_code)  # type: ignore[arg-type]
            elif isinstance(e, h2ev.ConnectionTerminated):
                self.goaway = (int(e.error_code), int(e.last_stream_id))  # type: ignore[arg-type]
            elif isinstance(e, h2ev.PingAckReceived):
                self.pongs += 1
            elif isinstance(e, h2ev.WindowUpdated):
                self.flush_pending()

    def output(self) -> bytes:
        return self.conn.data_to_send()

    def open(self, headers: list[tuple[str, str]]) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, headers)
        return sid

    def respond(self, sid: int) -> None:
        self.conn.send_headers(sid, [(":status", "200")])

    def send(self, sid: int, data: bytes, pad: int) -> int:
        window = self.conn.local_flow_control_window(sid)
        cost = pad + 1 if pad else 0
        n = min(len(data), window - cost, self.conn.max_outbound_frame_size - cost)
        if n <= 0:
            return 0
        self.conn.send_data(sid, data[:n], pad_length=pad or None)
        return n

    def end(self, sid: int) -> None:
        self.conn.end_stream(sid)

    def reset(self, sid: int, code: int) -> None:
        self.conn.reset_stream(sid, code)

    def ack(self, sid: int, n: int) -> None:
        self.conn.acknowledge_received_data(n, sid)  # a closed stream's bytes: the connection's only

    def goaway_now(self) -> None:
        self.conn.close_connection()

    def ping(self) -> None:
        self.conn.ping(b"12345678")


def cut(data: bytes, cuts: list[int]) -> Iterator[bytes]:
    last = 0
    for at in sorted({c % (len(data) + 1) for c in cuts}):
        yield data[last:at]
        last = at
    yield data[last:]


class Pairing:
    """A client and a server endpoint joined in memory, run through one script."""

    def __init__(self, client: Endpoint, server: Endpoint, cuts: list[int]) -> None:
        self.client = client
        self.server = server
        self.cuts = cuts
        self.over = False

    def exchange(self, release: bool = False, rounds: int = 200) -> None:
        for _ in range(rounds):
            if release:
                self.client.release()
                self.server.release()
            for side in (self.client, self.server):
                side.flush_pending()
            to_server, to_client = self.client.output(), self.server.output()
            if not to_server and not to_client:
                return
            for piece in cut(to_server, self.cuts):
                self.server.receive(piece)
            for piece in cut(to_client, self.cuts):
                self.client.receive(piece)
        raise AssertionError("the exchange does not settle")


@dataclass
class Script:
    """The script-level state, the same for every pairing: which ops apply."""

    streams: list[int] = field(default_factory=list)
    ended: set[tuple[int, str]] = field(default_factory=set)
    responded: set[int] = field(default_factory=set)
    reset: set[int] = field(default_factory=set)


_open = st.tuples(st.just("open"), st.booleans())
_respond = st.tuples(st.just("respond"), st.integers(0, 7))
_data = st.tuples(
    st.just("data"),
    st.integers(0, 7),
    st.sampled_from(["client", "server"]),
    st.integers(0, 150_000),
    st.sampled_from([0, 0, 1, 7, 200]),
)
_end = st.tuples(st.just("end"), st.integers(0, 7), st.sampled_from(["client", "server"]))
_reset = st.tuples(
    st.just("reset"), st.integers(0, 7), st.sampled_from(["client", "server"]), st.sampled_from([0, 2, 8])
)
_hold = st.tuples(st.just("hold"), st.sampled_from(["client", "server"]), st.booleans())
_other = st.sampled_from([("exchange",), ("ping",)])
# Weighted towards streams that carry data; a GOAWAY, when there is one, ends the script.
op = st.one_of(
    _open, _open, _respond, _respond, _data, _data, _data, _data, _end, _reset, _hold, _hold, _other
)
script = st.tuples(st.lists(op, max_size=40), st.sampled_from([[], [], [("goaway",)]])).map(
    lambda parts: parts[0] + parts[1]
)


def run(ops: list[tuple[Any, ...]], client: Endpoint, server: Endpoint, cuts: list[int]) -> dict[str, Any]:
    p = Pairing(client, server, cuts)
    s = Script()
    p.exchange()  # the prefaces
    for n, step in enumerate(ops):
        kind = step[0]
        if kind == "open" and len(s.streams) < 8:
            headers = [(":method", "CONNECT"), (":authority", f"10.0.0.{len(s.streams)}:80")]
            if step[1]:
                headers.append(("x-big", "v" * BIG_VALUE))
            s.streams.append(client.open(headers))
        elif kind == "hold":
            side = client if step[1] == "client" else server
            side.holding = step[2]
            if not side.holding:
                side.release()
        elif kind == "exchange":
            p.exchange()
        elif kind == "ping":
            client.ping()
        elif kind == "goaway":
            p.exchange(release=True)
            server.goaway_now()
            p.exchange()
            break
        elif s.streams and kind in ("respond", "data", "end", "reset"):
            sid = s.streams[step[1] % len(s.streams)]
            if sid in s.reset:
                continue
            if kind == "respond" and sid not in s.responded:
                p.exchange()  # the request has arrived
                server.respond(sid)
                s.responded.add(sid)
            elif kind in ("data", "end"):
                who = step[2]
                if (sid, who) in s.ended or (who == "server" and sid not in s.responded):
                    continue
                side = client if who == "client" else server
                if kind == "data":
                    tag = f"<{sid}:{n}>".encode()
                    payload = (tag * (step[3] // len(tag) + 1))[: step[3]]
                    side.queue(sid, payload, False, step[4])
                else:
                    side.queue(sid, b"", True, 0)
                    s.ended.add((sid, who))
            elif kind == "reset":
                p.exchange(release=True)  # quiet first: what was sent before has arrived
                (client if step[2] == "client" else server).reset(sid, step[3])
                s.reset.add(sid)
    client.holding = server.holding = False
    p.exchange(release=True)
    return {
        "client": {sid: vars(seen) for sid, seen in sorted(client.seen.items())},
        "server": {sid: vars(seen) for sid, seen in sorted(server.seen.items())},
        "goaway": (client.goaway, server.goaway),
        "pongs": client.pongs,
        "pending": (client.pending, server.pending),
    }


@FUZZ
@given(ops=script, cuts=st.lists(st.integers(0, 1 << 18), max_size=8))
def test_our_core_and_h2_observe_the_same_exchanges(ops: list[tuple[Any, ...]], cuts: list[int]) -> None:
    reference = run(ops, H2(True), H2(False), cuts)
    for seen in (*reference["client"].values(), *reference["server"].values()):
        if len(seen["data"]) > 65535:
            event("a window ran dry and refilled")
        if seen["reset"] is not None:
            event("a stream reset")
        if seen["headers"] is not None and len(seen["headers"]) > 2:
            event("a header block over CONTINUATION")
    if reference["goaway"][0] is not None and any(not v["ended"] for v in reference["client"].values()):
        event("a GOAWAY with streams open")
    ours_client = run(ops, Ours(True), H2(False), cuts)
    ours_server = run(ops, H2(True), Ours(False), cuts)
    assert ours_client == reference
    assert ours_server == reference


def test_the_oracle_sees_the_features_it_is_meant_to() -> None:
    """The generator's parts do happen: windows run dry, blocks span CONTINUATIONs, resets land."""
    ops: list[tuple[Any, ...]] = [
        ("open", True),
        ("open", False),
        ("respond", 1),
        ("hold", "server", True),
        ("data", 0, "client", 150_000, 7),
        ("exchange",),
        ("data", 1, "server", 100_000, 0),
        ("hold", "server", False),
        ("reset", 1, "client", 8),
        ("end", 0, "client"),
        ("ping",),
        ("goaway",),
    ]
    reference = run(ops, H2(True), H2(False), [100, 5000, 70_000])
    assert len(reference["server"][1]["data"]) == 150_000 and reference["server"][1]["ended"]
    assert reference["client"][3]["data"] == bytearray() or len(reference["client"][3]["data"]) <= 100_000
    assert reference["server"][3]["reset"] == 8
    assert reference["goaway"][0] == (0, 3) and reference["pongs"] == 1
    assert run(ops, Ours(True), H2(False), [100, 5000, 70_000]) == reference
    assert run(ops, H2(True), Ours(False), [100, 5000, 70_000]) == reference
