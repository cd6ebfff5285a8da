"""The values the local config's YAML is read into beyond plain JSON ones (`localyaml.py` makes
them), and `plain`, the document back as JSON values. No YAML library here: the model's readers
(`localconfig.py`) need these types in every process, the parser only where a file is read.
"""

from __future__ import annotations

import base64
import datetime
from dataclasses import dataclass
from typing import Any

from policy.model import StringMatchKind


@dataclass(frozen=True, slots=True)
class Tagged:
    """A value written with a local tag (`!Exact "x"`); only string matches may carry one."""

    tag: str
    value: object


class WrittenInt(int):
    """An int that remembers how it was written: a string field takes the text (`canonicalRevision: 010`)."""

    text = ""


class WrittenFloat(float):
    text = ""


def plain(value: object) -> Any:
    """The document as JSON values: tags become the map form, other YAML-only types strings."""
    if isinstance(value, Tagged):
        inner = [] if value.tag == StringMatchKind.PRESENCE.value else plain(value.value)
        return {value.tag: inner}
    if isinstance(value, dict):
        return {
            k if isinstance(k, str | int | float | bool) or k is None else str(k): plain(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, WrittenInt):
        return int(value)
    if isinstance(value, WrittenFloat):
        return float(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)
