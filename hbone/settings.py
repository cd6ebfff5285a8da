"""HTTP/2 parameters of an HBONE connection (SPEC §2.4, §12.3): one immutable object, passed in."""

from __future__ import annotations

from dataclasses import dataclass

from h2.settings import SettingCodes


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
    # Per-stream send buffer before the writer is paused on the server side (SPEC §2.4).
    server_send_buffer: int = 409600

    @property
    def client_send_buffer(self) -> int:
        """Per-stream send buffer on the client side: the stream window (SPEC §2.4)."""
        return self.stream_window

    def local_settings(self, *, client_side: bool) -> dict[SettingCodes, int]:
        """The SETTINGS frame this side sends first."""
        values: dict[SettingCodes, int] = {
            SettingCodes.INITIAL_WINDOW_SIZE: self.stream_window,
            SettingCodes.MAX_FRAME_SIZE: self.frame_size,
        }
        if client_side:
            values[SettingCodes.ENABLE_PUSH] = 0
            values[SettingCodes.MAX_HEADER_LIST_SIZE] = self.client_max_header_list
        else:
            values[SettingCodes.MAX_CONCURRENT_STREAMS] = self.max_concurrent_streams
            values[SettingCodes.MAX_HEADER_LIST_SIZE] = self.server_max_header_list
        return values
