"""HTTP/2's error codes and setting identifiers (RFC 9113 §7, §6.5.2), and the core's exceptions."""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


def error_name(code: int) -> str:
    """`PROTOCOL_ERROR` for 1; an unknown code (which a peer may send) as its number."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"0x{code:x}"


class SettingCode(enum.IntEnum):
    HEADER_TABLE_SIZE = 0x1
    ENABLE_PUSH = 0x2
    MAX_CONCURRENT_STREAMS = 0x3
    INITIAL_WINDOW_SIZE = 0x4
    MAX_FRAME_SIZE = 0x5
    MAX_HEADER_LIST_SIZE = 0x6
    ENABLE_CONNECT_PROTOCOL = 0x8


class H2ConnectionError(Exception):
    """A connection error (RFC 9113 §5.4.1) found in the peer's bytes: GOAWAY(`code`), the end."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class H2StreamError(Exception):
    """A stream error (RFC 9113 §5.4.2): RST_STREAM(`code`) on that stream alone."""

    def __init__(self, stream_id: int, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.stream_id = stream_id
        self.code = code


class H2UsageError(Exception):
    """A command the connection cannot carry out in its state (e.g. a new stream after GOAWAY)."""


class LimitBroken(H2ConnectionError):
    """The peer broke one of our abuse limits (`hbone.settings.H2Settings`)."""
