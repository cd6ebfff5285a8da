"""HTTP/2 parameters of an HBONE connection: one immutable object, passed in.

Besides the negotiated values it states the limits that keep one abusive peer from costing the
node more than one connection's worth: each is enforced per connection, and exceeding it closes
that connection (GOAWAY naming the error) or refuses one stream, never more.
"""

from __future__ import annotations

from dataclasses import dataclass

from hbone.h2core.codes import SettingCode

# The pool's defaults, as the reference's (`POOL_MAX_STREAMS_PER_CONNECTION`,
# `POOL_UNUSED_RELEASE_TIMEOUT`): streams one pooled connection carries at once, and how long a pooled
# connection that carries none is kept. Written here once; the configuration and the pool read them.
POOL_MAX_STREAMS = 100
POOL_IDLE_TIMEOUT = 300.0
# After a failed dial, the next dial to the same key waits: 25 ms, doubling with each failure in a
# row up to 1 s, each wait drawn between half and all of that (jitter, so peers do not retry in step).
POOL_BACKOFF_INITIAL = 0.025
POOL_BACKOFF_MAX = 1.0


@dataclass(frozen=True)
class H2Settings:
    stream_window: int = 4194304  # HTTP2_STREAM_WINDOW_SIZE
    connection_window: int = 16777216  # HTTP2_CONNECTION_WINDOW_SIZE
    frame_size: int = 1048576  # HTTP2_FRAME_SIZE
    max_concurrent_streams: int = 200  # advertised by the server
    client_max_header_list: int = 16384
    server_max_header_list: int = 65536
    ping_interval: float = 10.0
    ping_timeout: float = 20.0
    # Per-stream send buffer before the writer is paused on the server side.
    server_send_buffer: int = 409600
    # -- abuse limits (ours; the reference's h2 library has equivalents) --
    # Compressed bytes of one header block (HEADERS + CONTINUATIONs), checked at each frame header,
    # before anything is buffered or decoded: a block that is larger is a GOAWAY(ENHANCE_YOUR_CALM).
    # Twice the larger header list size: HPACK never needs more for a list it would accept.
    max_header_block: int = 131072
    # CONTINUATION frames in one header block (a flood of empty ones costs per frame, not per byte).
    max_continuations: int = 16
    # Rapid reset (CVE-2023-44487, CVE-2025-8671 "MadeYouReset"): streams the peer resets before
    # they were answered, plus the resets its frames make us send (frames on closed streams, streams
    # refused), counted per connection in windows of `reset_window` seconds; past `max_resets` in
    # one window: GOAWAY(ENHANCE_YOUR_CALM), a warning, and the connection closes.
    max_resets: int = 1000
    reset_window: float = 10.0
    # While the TLS transport's buffer is over its high-water mark (the peer does not read), the
    # replies our received frames produce (PING and SETTINGS ACKs, resets) may add this many bytes;
    # past it the session stops reading until the buffer drains (a PING/SETTINGS flood stalls).
    paused_output_limit: int = 65536
    # A TLS server handshake, from accept to the first HTTP/2 byte; the first TLS record (the
    # ClientHello) is awaited without a TLS object, and bytes that are not a TLS handshake record
    # close the connection at once.
    handshake_timeout: float = 10.0

    @property
    def client_send_buffer(self) -> int:
        """Per-stream send buffer on the client side: the stream window."""
        return self.stream_window

    def local_settings(self, *, client_side: bool) -> dict[SettingCode, int]:
        """The SETTINGS frame this side sends first."""
        values: dict[SettingCode, int] = {
            SettingCode.INITIAL_WINDOW_SIZE: self.stream_window,
            SettingCode.MAX_FRAME_SIZE: self.frame_size,
        }
        if client_side:
            values[SettingCode.ENABLE_PUSH] = 0
            values[SettingCode.MAX_HEADER_LIST_SIZE] = self.client_max_header_list
        else:
            values[SettingCode.MAX_CONCURRENT_STREAMS] = self.max_concurrent_streams
            values[SettingCode.MAX_HEADER_LIST_SIZE] = self.server_max_header_list
        return values
