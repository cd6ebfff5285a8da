"""HBONE's HTTP/2, without I/O: `H2Core` takes bytes and the time, returns events and bytes to send."""

from hbone.h2core.codes import (
    ErrorCode,
    H2ConnectionError,
    H2StreamError,
    H2UsageError,
    SettingCode,
    error_name,
)
from hbone.h2core.connection import STEP_DATA, STEP_DONE, STEP_EVENTS, H2Core

__all__ = [
    "STEP_DATA",
    "STEP_DONE",
    "STEP_EVENTS",
    "ErrorCode",
    "H2ConnectionError",
    "H2Core",
    "H2StreamError",
    "H2UsageError",
    "SettingCode",
    "error_name",
]
