"""The checks of a received header block (RFC 9113 §8.2, §8.3, §8.5), decoded by `hpack`.

A block that breaks them is a malformed message: a stream error PROTOCOL_ERROR on its stream alone
(§8.1.1); the HPACK state stays intact since the block was decoded whole.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from hbone.h2core.codes import ErrorCode, H2StreamError
from hbone.h2core.events import Headers

# A name holds no byte in 0x00-0x20, "A"-"Z" or 0x7f-0xff, and no colon past its first byte; a value
# holds no NUL, LF or CR, and does not start or end with SP or HTAB (§8.2.1).
_BAD_NAME = re.compile(rb"[\x00-\x20A-Z\x7f-\xff]|(?<=.):")
_BAD_VALUE = re.compile(rb"[\x00\n\r]|^[ \t]|[ \t]$")
# Connection-specific fields (§8.2.2); `te` is allowed with the value "trailers" only.
_CONNECTION_SPECIFIC = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)
_REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":authority", b":path"})
_STATUS = re.compile(rb"[0-9]{3}")


def _malformed(stream_id: int, why: str) -> H2StreamError:
    return H2StreamError(stream_id, ErrorCode.PROTOCOL_ERROR, f"malformed header block: {why}")


def _walk(
    stream_id: int, raw: Iterable[tuple[bytes, bytes]], allowed_pseudo: frozenset[bytes]
) -> tuple[dict[bytes, bytes], Headers, int | None]:
    """The pseudo-header fields, every field as text (pseudo first), and the content-length."""
    pseudo: dict[bytes, bytes] = {}
    fields: Headers = []
    regular = False
    length: int | None = None
    for name, value in raw:
        if _BAD_NAME.search(name) is not None or not name:
            raise _malformed(stream_id, f"invalid field name {name!r}")
        if value and _BAD_VALUE.search(value) is not None:
            raise _malformed(stream_id, f"invalid value of field {name!r}")
        if name[0] == 0x3A:  # ":"
            if regular or name not in allowed_pseudo or name in pseudo:
                raise _malformed(stream_id, f"pseudo-header field {name!r} not allowed here")
            pseudo[name] = value
        else:
            regular = True
            if name in _CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
                raise _malformed(stream_id, f"connection-specific field {name!r}")
            if name == b"content-length":
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise _malformed(stream_id, "invalid content-length")
                length = int(value)
        fields.append((name.decode("ascii"), value.decode("utf-8", "replace")))
    return pseudo, fields, length


def check_request(stream_id: int, raw: Iterable[tuple[bytes, bytes]]) -> tuple[Headers, int | None]:
    pseudo, fields, length = _walk(stream_id, raw, _REQUEST_PSEUDO)
    method = pseudo.get(b":method")
    if method is None:
        raise _malformed(stream_id, "no :method")
    if method == b"CONNECT":
        if b":scheme" in pseudo or b":path" in pseudo or not pseudo.get(b":authority"):
            raise _malformed(stream_id, "CONNECT takes :authority alone")
    elif not pseudo.get(b":scheme") or not pseudo.get(b":path"):
        raise _malformed(stream_id, "no :scheme or :path")
    return fields, length


_RESPONSE_PSEUDO = frozenset({b":status"})
_NO_PSEUDO: frozenset[bytes] = frozenset()


def check_response(stream_id: int, raw: Iterable[tuple[bytes, bytes]]) -> tuple[Headers, int, int | None]:
    pseudo, fields, length = _walk(stream_id, raw, _RESPONSE_PSEUDO)
    status = pseudo.get(b":status")
    if status is None or _STATUS.fullmatch(status) is None:
        raise _malformed(stream_id, "no valid :status")
    return fields, int(status), length


def check_trailers(stream_id: int, raw: Iterable[tuple[bytes, bytes]]) -> Headers:
    return _walk(stream_id, raw, _NO_PSEUDO)[1]
