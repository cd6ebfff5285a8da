"""Helpers of the sans-IO HTTP/2 core's tests: a core past its preface, and its output as frames."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import hpack

from hbone.h2core import H2Core
from hbone.h2core import events as ev
from hbone.settings import H2Settings
from tests.h2peer import ACK, END_HEADERS, HEADERS, PREFACE, SETTINGS, frame


@dataclass
class Out:
    type: int
    flags: int
    stream_id: int
    payload: bytes

    @property
    def error_code(self) -> int:
        at = 4 if self.type == 7 else 0  # GOAWAY: after the last stream id
        return int(struct.unpack(">L", self.payload[at : at + 4])[0])

    @property
    def last_stream_id(self) -> int:
        return int(struct.unpack(">L", self.payload[:4])[0]) & 0x7FFFFFFF


def frames(data: bytes) -> list[Out]:
    out = []
    while data:
        hi, lo, ftype, flags, sid = struct.unpack(">HBBBL", data[:9])
        n = (hi << 8) | lo
        out.append(Out(ftype, flags, sid & 0x7FFFFFFF, data[9 : 9 + n]))
        data = data[9 + n :]
    return out


class Server:
    """A server core, its preface done with a raw client; `feed` returns the events."""

    def __init__(self, settings: H2Settings | None = None) -> None:
        self.settings = settings or H2Settings()
        self.core = H2Core(client_side=False, settings=self.settings, now=0.0)
        self.core.initiate(self.settings.local_settings(client_side=False), 0.0)
        self.encoder = hpack.Encoder()
        self.now = 0.0
        self.events: list[ev.Event] = []
        self.feed(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0))
        self.output()

    def feed(self, data: bytes) -> list[ev.Event]:
        events = self.core.receive(data, self.now)
        self.events += events
        return events

    def output(self) -> list[Out]:
        return frames(b"".join(bytes(c) for c in self.core.take_output()))

    def block(self, authority: str = "127.0.0.1:80", **extra: str) -> bytes:
        return bytes(self.encoder.encode([(":method", "CONNECT"), (":authority", authority), *extra.items()]))

    def request(self, sid: int, authority: str = "127.0.0.1:80") -> bytes:
        return frame(HEADERS, END_HEADERS, sid, self.block(authority))


def of(events: list[ev.Event], kind: type[ev.Event]) -> list[ev.Event]:
    return [e for e in events if type(e) is kind]
