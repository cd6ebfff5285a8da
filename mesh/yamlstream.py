"""The local config's YAML read item by item: each entry of the top-level lists built from libyaml's
events as it is reached and handed on, so that a mesh of 100,000 workloads is never held as one tree
of YAML nodes (PyYAML's whole-document load takes about 30 s and 1.5 GB for one).

Only the plain shape of a configuration is read this way: mappings, lists and scalars, local tags
(`!Prefix "x"`, `!Presence []`), no anchors, aliases, merge keys, explicit `!!` tags or floats. Anything else,
and any error, raises `Unsupported`: the caller reads the file again with the whole-document loader
(`localyaml.load`), which gives every value its full meaning and every error its line and reason. For
what it does read, the values are the ones `localyaml.load` builds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml

from mesh import localyaml
from mesh.yamlvalues import Tagged, WrittenInt

__all__ = ["Unsupported", "available", "items"]


class Unsupported(Exception):
    """Not read here (a shape outside the plain one, or an error): read the whole document instead."""


def available() -> bool:
    return localyaml.FastLoader is not None


# The plain scalars that are not strings, as `localyaml`'s schema resolves them.
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_SPECIAL_START = frozenset("-+.0123456789tTfFnN~<")  # where a bool, int, float, null or merge key starts


def _int(text: str) -> WrittenInt:
    digits = text.replace("_", "").lstrip("+-")
    magnitude = int(digits, 0) if digits[:2] in ("0o", "0x") else int(digits, 10)
    number = WrittenInt(-magnitude if text.startswith("-") else magnitude)
    number.text = text
    return number


def _text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise Unsupported("surrogate escapes") from None
    return value


def _local(tag: str) -> bool:
    """`!Exact` and the like, kept as `Tagged`; `!!int` arrives expanded (`tag:yaml.org,2002:int`)."""
    return tag.startswith("!") and len(tag) > 1 and not tag.startswith("!!")


def _scalar(event: Any) -> object:
    if event.anchor is not None:
        raise Unsupported("anchor")
    value: str = event.value
    tag = event.tag
    if tag is not None:
        if _local(tag):
            return Tagged(tag[1:], _text(value))
        raise Unsupported("explicit tag")
    if not event.implicit[0] or (value and value[0] not in _SPECIAL_START):
        return _text(value)  # quoted, or plain text no other type starts with
    if _INT.match(value):
        return _int(value)
    if _NULL.match(value):
        return None
    if _BOOL.match(value):
        return value.lower() == "true"
    if _FLOAT.match(value) or value == "<<":
        raise Unsupported("a float or a merge key")
    return _text(value)


class _Events:
    """libyaml's events, with the nesting bound `localyaml` checks."""

    def __init__(self, text: str) -> None:
        loader = localyaml.FastLoader
        if loader is None:
            raise Unsupported("PyYAML without libyaml")
        self._get = loader(text).get_event  # libyaml's parser, without a composer or a constructor
        self.depth = 0

    def next(self) -> Any:
        try:
            event = self._get()
        except yaml.YAMLError as e:
            raise Unsupported("invalid YAML") from e
        if event is None:
            raise Unsupported("ended early")
        return event

    def value(self, event: Any) -> object:
        """The value that starts with `event`."""
        if isinstance(event, yaml.ScalarEvent):
            return _scalar(event)
        if event.anchor is not None:
            raise Unsupported("anchor")
        if event.tag is not None:
            if not _local(event.tag):
                raise Unsupported("explicit tag")
            return Tagged(event.tag[1:], self._collection(event))  # `!Presence []`
        return self._collection(event)

    def _collection(self, event: Any) -> object:
        if isinstance(event, yaml.SequenceStartEvent):
            self._enter()
            items = []
            while not isinstance(inner := self.next(), yaml.SequenceEndEvent):
                items.append(self.value(inner))
            self.depth -= 1
            return items
        if isinstance(event, yaml.MappingStartEvent):
            self._enter()
            mapping: dict[Any, Any] = {}
            while not isinstance(inner := self.next(), yaml.MappingEndEvent):
                key = self.value(inner)
                try:
                    if isinstance(key, list | dict) or key in mapping:
                        raise Unsupported("duplicate key")
                except TypeError:  # a tagged list: `{!Exact [1]: x}`
                    raise Unsupported("unhashable key") from None
                mapping[key] = self.value(self.next())
            self.depth -= 1
            return mapping
        raise Unsupported(type(event).__name__)  # an alias

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > localyaml.MAX_DEPTH:
            raise Unsupported("nesting")


def items(text: str, keys: tuple[str, ...]) -> Iterator[tuple[str, object]]:
    """(top-level key, one entry of its list) for every entry, in the document's order; a key written
    with null has none. Raises `Unsupported` for what it does not read (see the module's note)."""
    events = _Events(text)
    if not isinstance(events.next(), yaml.StreamStartEvent):
        raise Unsupported("stream")
    start = events.next()
    if not isinstance(start, yaml.DocumentStartEvent):
        raise Unsupported("no document")
    top = events.next()
    if not isinstance(top, yaml.MappingStartEvent) or top.anchor is not None or top.tag is not None:
        raise Unsupported("not a plain mapping")
    events.depth = 2  # the document's mapping and a list hold every entry
    seen: set[str] = set()
    while not isinstance(event := events.next(), yaml.MappingEndEvent):
        key = events.value(event)
        if not isinstance(key, str) or key not in keys or key in seen:
            raise Unsupported("top-level key")
        seen.add(key)
        first = events.next()
        if isinstance(first, yaml.ScalarEvent) and _scalar(first) is None:
            continue
        if (
            not isinstance(first, yaml.SequenceStartEvent)
            or first.anchor is not None
            or first.tag is not None
        ):
            raise Unsupported("not a plain list")
        while not isinstance(entry := events.next(), yaml.SequenceEndEvent):
            yield key, events.value(entry)
    if not isinstance(events.next(), yaml.DocumentEndEvent) or not isinstance(
        events.next(), yaml.StreamEndEvent
    ):
        raise Unsupported("more than one document")
