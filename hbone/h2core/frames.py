"""HTTP/2's frame layout (RFC 9113 §4, §6): the preface, frame types, flags and default sizes, and
the parse of a buffered control frame."""

from __future__ import annotations

import struct
from typing import Final

from hyperframe.exceptions import HyperframeError, InvalidDataError, InvalidPaddingError
from hyperframe.frame import Frame

from hbone.h2core.codes import ErrorCode, H2ConnectionError, H2StreamError

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_WINDOW: Final = 65535
DEFAULT_FRAME_SIZE: Final = 16384
MAX_WINDOW: Final = 2**31 - 1
# DATA payloads from this size on are queued as they are (a separate buffer for `writelines`).
LARGE_DATA: Final = 16 * 1024
# The most plaintext one TLS record carries (RFC 8446 §5.1).
TLS_RECORD: Final = 16 * 1024

FRAME_HEADER = struct.Struct(">HBBBL")  # length (24 bits as 16+8), type, flags, stream id
WINDOW_UPDATE_FRAME = struct.Struct(">HBBBLL")  # a frame header, then the increment
TYPE_DATA: Final = 0x0
TYPE_HEADERS: Final = 0x1
TYPE_PRIORITY: Final = 0x2
TYPE_RST_STREAM: Final = 0x3
TYPE_SETTINGS: Final = 0x4
TYPE_PUSH_PROMISE: Final = 0x5
TYPE_PING: Final = 0x6
TYPE_GOAWAY: Final = 0x7
TYPE_WINDOW_UPDATE: Final = 0x8
TYPE_CONTINUATION: Final = 0x9
FLAG_END_STREAM: Final = 0x1
FLAG_ACK: Final = 0x1
FLAG_END_HEADERS: Final = 0x4
FLAG_PADDED: Final = 0x8
FLAG_PRIORITY: Final = 0x20


def parse_frame(ftype: int, flags: int, sid: int, body: memoryview) -> Frame:
    """A buffered frame other than HEADERS and CONTINUATION, parsed by `hyperframe` once its
    length is checked; raises the connection or stream error RFC 9113 names for a malformed one."""
    n = len(body)
    if (
        (ftype == TYPE_PING and n != 8)
        or (ftype in (TYPE_RST_STREAM, TYPE_WINDOW_UPDATE) and n != 4)
        or (ftype == TYPE_SETTINGS and (n % 6 or (flags & 1 and n)))
        or (ftype == TYPE_GOAWAY and n < 8)
    ):
        raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, f"frame type {ftype} of {n} bytes")
    if ftype == TYPE_WINDOW_UPDATE and not int.from_bytes(body, "big") & MAX_WINDOW:
        if sid:  # a zero increment: a stream error on a stream, else a connection error
            raise H2StreamError(sid, ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
    try:
        frame, _ = Frame.parse_frame_header(
            memoryview(FRAME_HEADER.pack(n >> 8, n & 0xFF, ftype, flags, sid))
        )
        frame.parse_body(body)
    except (InvalidPaddingError, InvalidDataError) as e:
        raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"invalid frame: {e}") from None
    except HyperframeError as e:
        raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, f"invalid frame: {e}") from None
    return frame
