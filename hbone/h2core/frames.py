"""HTTP/2's frame layout (RFC 9113 §4, §6): the preface, frame types, flags and default sizes."""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_WINDOW = 65535
DEFAULT_FRAME_SIZE = 16384
MAX_WINDOW = 2**31 - 1
# DATA payloads from this size on are queued as they are (a separate buffer for `writelines`).
LARGE_DATA = 16 * 1024

FRAME_HEADER = struct.Struct(">HBBBL")  # length (24 bits as 16+8), type, flags, stream id
WINDOW_UPDATE_FRAME = struct.Struct(">HBBBLL")  # a frame header, then the increment
TYPE_DATA = 0x0
TYPE_HEADERS = 0x1
TYPE_PRIORITY = 0x2
TYPE_RST_STREAM = 0x3
TYPE_SETTINGS = 0x4
TYPE_PUSH_PROMISE = 0x5
TYPE_PING = 0x6
TYPE_GOAWAY = 0x7
TYPE_WINDOW_UPDATE = 0x8
TYPE_CONTINUATION = 0x9
FLAG_END_STREAM = 0x1
FLAG_ACK = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20
