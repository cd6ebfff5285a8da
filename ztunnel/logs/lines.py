"""Logging: the level filter, the plain and JSON line formats, and access-log emission.

Logger names are the targets of the reference: `access` for access logs, `dns` for DNS queries and the
module path (`ztunnel.proxy`, `hbone.pool`, …) for the rest; the `ztunnel.` prefix is not printed, as the
reference strips `ztunnel::`. Structured fields travel on the record as `extra={"fields": mapping}`.

Lines reach stderr through `LogWriter` (`ztunnel.logs.writer`): bounded and lossy, written by a thread
of its own, so a stderr nobody reads never blocks an event loop; what it had to drop is counted
(`ztunnel_log_lines_dropped_total`) and reported in a line once it drains.

Filter syntax, as `RUST_LOG`: comma-separated directives, each a level (the default) or
`target=level`, where the target matches that logger and its children; `::` in a target is read as
`.`. Levels: error, warn, info, debug, trace, off. Without a default directive the default is `info`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple, TextIO, cast

from hbone.address import format_addr
from ztunnel.logs.writer import LogWriter

TRACE = 5
OFF = logging.CRITICAL + 10
logging.addLevelName(TRACE, "TRACE")

LEVELS: Mapping[str, int] = {
    "error": logging.ERROR,
    "warn": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": TRACE,
    "off": OFF,
}

ACCESS = logging.getLogger("access")

_TARGET_PREFIX = "ztunnel."


class Bare(str):
    """A string value printed without quotes in the plain format (addresses and the like)."""

    __slots__ = ()


@dataclass(frozen=True)
class LogFilter:
    """A parsed filter: the default level (None: not given) and per-target levels in order."""

    default: str | None
    targets: tuple[tuple[str, str], ...] = ()

    def merged(self, other: LogFilter) -> LogFilter:
        """`other` appended to this filter: its default and targets replace the ones they name."""
        targets = dict(self.targets)
        for target, level in other.targets:
            targets.pop(target, None)
            targets[target] = level
        return LogFilter(other.default or self.default, tuple(targets.items()))

    def __str__(self) -> str:
        parts = [self.default or "info"]
        parts.extend(f"{target}={level}" for target, level in self.targets)
        return ",".join(parts)


def parse_filter(spec: str) -> LogFilter:
    """Parse `info,access=debug`; raise ValueError naming the bad directive."""
    default: str | None = None
    targets: dict[str, str] = {}
    directives = [d.strip() for d in spec.split(",")]
    if not any(directives):
        raise ValueError("empty log level")
    for directive in directives:
        if not directive:
            continue
        target, sep, level = directive.rpartition("=")
        level = level.strip().lower()
        if level not in LEVELS:
            raise ValueError(
                f"invalid level {level!r} in {directive!r} (expected one of {', '.join(LEVELS)})"
            )
        if not sep:
            default = level
            continue
        target = target.strip().replace("::", ".")
        if not target or any(c in target for c in "=[]{} "):
            raise ValueError(f"invalid target in {directive!r}")
        targets.pop(target, None)
        targets[target] = level
    return LogFilter(default, tuple(targets.items()))


class _State:
    handler: LineHandler | None = None
    writer: LogWriter | None = None
    startup = LogFilter("info")
    current = LogFilter("info")
    touched: set[str] = set()


# Third-party libraries whose debug output is per frame; silent unless a filter names them (as the
# reference prefixes its filter with `hickory_server::server=off`).
QUIET_TARGETS = ("hpack", "h2", "grpc", "asyncio")


def _apply(flt: LogFilter) -> None:
    logging.getLogger().setLevel(LEVELS[flt.default or "info"])
    wanted = dict(flt.targets)
    for name in QUIET_TARGETS:
        wanted.setdefault(name, "warn")
    for name in _State.touched - wanted.keys():
        logging.getLogger(name).setLevel(logging.NOTSET)
    for name, level in wanted.items():
        logging.getLogger(name).setLevel(LEVELS[level])
    _State.touched = set(wanted)
    _State.current = flt


def setup_logging(
    log_format: str, level_filter: str, stream: TextIO | None = None, *, fd: int | None = None
) -> None:
    """Install the formatter on the root logger and apply the filter. Lines go to stderr (or `fd`)
    through a `LogWriter`; to `stream` directly when one is given (tests)."""
    # Neither format prints the caller's file and line, the thread or the process: the records need
    # not look them up (a frame walk and a getpid() per line, on every access log line).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    if log_format == "plain":
        formatter: LineFormatter = PlainFormatter()
    elif log_format == "json":
        formatter = JsonFormatter()
    else:
        raise ValueError(f"invalid log format {log_format!r} (expected plain or json)")
    flt = parse_filter(level_filter)
    _remove_handler()
    if stream is None and fd is None:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            fd = sys.stderr.fileno()
    if stream is None and fd is not None:
        writer = LogWriter(fd, report=lambda n: formatter.line(_dropped_line(n)) + "\n")
        handler = LineHandler(formatter, writer.write, writer.flush, writer.close)
        _State.writer = writer
    else:
        out = stream if stream is not None else sys.stderr
        handler = LineHandler(formatter, out.write, out.flush)
    logging.getLogger().addHandler(handler)
    _State.handler = handler
    _State.startup = flt
    _apply(flt)


def _remove_handler() -> None:
    if _State.handler is not None:
        logging.getLogger().removeHandler(_State.handler)
        _State.handler.close()
        _State.handler = None
    _State.writer = None


def reset_logging() -> None:
    """Undo `setup_logging`: remove its handler and per-target levels (for tests and re-setup)."""
    _remove_handler()
    _State.startup = LogFilter("info")
    _apply(LogFilter("info"))
    logging.getLogger().setLevel(logging.WARNING)


def dropped_lines() -> int:
    """Log lines this process dropped because its log stream was not being read."""
    return _State.writer.dropped if _State.writer is not None else 0


def current_filter() -> str:
    return str(_State.current)


def set_filter(spec: str, reset: bool) -> str:
    """Change the filter at runtime (admin `/logging`): append `spec`, after going back to the startup
    filter when `reset`. Return the new filter; raise ValueError when `spec` is invalid."""
    base = _State.startup if reset else _State.current
    if spec or not reset:
        base = base.merged(parse_filter(spec))
    _apply(base)
    return str(base)


def log_fields(logger: logging.Logger, level: int, message: str, fields: Mapping[str, object]) -> None:
    """Emit `message` with structured `fields` (insertion order kept, None values left out)."""
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={"fields": fields})


# The spans a line was logged in, outermost first: (name, fields), e.g. ("inbound", {"id": trace id,
# "peer": address}). Plain lines show them after the target, JSON lines as one object per span.
Spans = tuple[tuple[str, Mapping[str, object]], ...]


def access_log(level: int, message: str, fields: Mapping[str, object], spans: Spans = ()) -> None:
    if not ACCESS.isEnabledFor(level):
        return
    handler = _State.handler
    if handler is not None and _direct(handler):
        _write_direct(handler, Line(time.time(), level, ACCESS.name, message, _present(fields), spans))
        return
    ACCESS.log(level, message, extra={"fields": fields, "spans": spans})


Item = tuple[str, object]


class FieldRun(tuple[Item, ...]):
    """Fields that repeat as they are from line to line (a connection's peers), None values left
    out. A line carries a run as the item `("", run)`; the plain format renders each distinct run
    once and keeps the text (the fields of the pair of workloads behind most of a node's lines)."""

    __slots__ = ()


def access_items(level: int, message: str, items: list[Item], spans: Spans = ()) -> None:
    """`access_log` with the fields as pairs, None values already left out, `("", FieldRun)` items
    standing for their fields."""
    if not ACCESS.isEnabledFor(level):
        return
    handler = _State.handler
    if handler is not None and _direct(handler):
        _write_direct(handler, Line(time.time(), level, ACCESS.name, message, items, spans))
        return
    ACCESS.log(level, message, extra={"fields": dict(_flat(items)), "spans": spans})


def _write_direct(handler: LineHandler, line: Line) -> None:
    """What `logging` would do with the record, minus the record: the same line, straight to the
    handler's sink (two lines per connection; the record machinery was most of it)."""
    formatter = cast(LineFormatter, handler.formatter)
    text = formatter.line(line)
    with handler.lock or contextlib.nullcontext():
        try:
            handler.write_line(text)
        except Exception:
            handler.handleError(logging.makeLogRecord({"msg": line.message, "levelno": line.levelno}))


def _flat(items: list[Item]) -> Iterator[Item]:
    """The fields of `items`, runs expanded."""
    for key, value in items:
        if key:
            yield key, value
        else:
            yield from cast(FieldRun, value)


def _direct(handler: LineHandler) -> bool:
    """Whether our handler alone would see an access record, unfiltered (no test capture, no filter)."""
    root = logging.root
    return (
        ACCESS.propagate
        and not ACCESS.handlers
        and not ACCESS.filters
        and len(root.handlers) == 1
        and root.handlers[0] is handler
        and not root.filters
        and not handler.filters
        and handler.level <= logging.NOTSET
    )


# --- the handler -------------------------------------------------------------------------------


class LineHandler(logging.Handler):
    """A record in one of our formats, handed as one line to `sink` (a `LogWriter`, or a stream)."""

    def __init__(
        self,
        formatter: LineFormatter,
        sink: Callable[[str], object],
        flush: Callable[[], object],
        close: Callable[[], object] | None = None,
    ) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self._sink = sink
        self._flush = flush
        self._close = close

    def write_line(self, line: str) -> None:
        self._sink(line + "\n")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write_line(self.format(record))
        except Exception:
            self.handleError(record)

    def flush(self) -> None:
        self._flush()

    def close(self) -> None:
        if self._close is not None:
            self._close()
        super().close()


def _dropped_line(n: int) -> Line:
    message = "log lines dropped: the log stream was not read in time"
    return Line(time.time(), logging.WARNING, "ztunnel.logs", message, [("dropped", n)], ())


def _spans(record: logging.LogRecord) -> Spans:
    return getattr(record, "spans", None) or ()


# --- formats -----------------------------------------------------------------------------------


def _level_name(levelno: int) -> str:
    if levelno >= logging.ERROR:
        return "error"
    if levelno >= logging.WARNING:
        return "warn"
    if levelno >= logging.INFO:
        return "info"
    if levelno >= logging.DEBUG:
        return "debug"
    return "trace"


def _target(name: str) -> str:
    return name[len(_TARGET_PREFIX) :] if name.startswith(_TARGET_PREFIX) else name


class _Clock:
    """The formatted current second, kept: the lines of one second share it."""

    second = -1
    prefix = ""


def _timestamp(created: float) -> str:
    second, micros = divmod(round(created * 1_000_000), 1_000_000)
    if second != _Clock.second:
        _Clock.prefix = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _Clock.second = second
    return f"{_Clock.prefix}.{micros:06d}Z"


def _quote(text: str) -> str:
    # Most values need no escaping (printable, no quote or backslash): quoted as they are.
    if text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    return json.dumps(text, ensure_ascii=False)


def _bare_text(value: object) -> str | None:
    """The unquoted rendering of values that print bare, or None for values that are quoted."""
    kind = type(value)
    if kind is str:
        return None
    if kind is int:
        return repr(value)
    if isinstance(value, Bare):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, ipaddress.IPv4Address | ipaddress.IPv6Address):
        return str(value)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int):
        return format_addr(value[0], value[1])
    return None


def _present(fields: Mapping[str, object]) -> list[tuple[str, object]]:
    """The fields a line shows: in order, None values left out."""
    return [(k, v) for k, v in fields.items() if v is not None]


def _fields(record: logging.LogRecord) -> list[tuple[str, object]]:
    items = _present(getattr(record, "fields", None) or {})
    if record.exc_info and record.exc_info[1] is not None:
        items.append(("exception", "".join(traceback.format_exception(record.exc_info[1])).rstrip()))
    return items


class Line(NamedTuple):
    """What a log line says, whichever way it came (a record, or an access log written directly)."""

    created: float
    levelno: int
    name: str
    message: str
    items: list[Item]  # the fields, None values left out (`("", FieldRun)`: the fields of a run)
    spans: Spans


class LineFormatter(logging.Formatter):
    """A format of ours: `line` renders one `Line`, for a record or without one."""

    def format(self, record: logging.LogRecord) -> str:
        return self.line(
            Line(
                record.created,
                record.levelno,
                record.name,
                record.getMessage(),
                _fields(record),
                _spans(record),
            )
        )

    def line(self, line: Line) -> str:
        raise NotImplementedError


class PlainFormatter(LineFormatter):
    """`<time>\\t<level>\\t<target>\\t"<message>"\\t<k=v …>`: strings quoted, numbers and addresses bare."""

    def line(self, line: Line) -> str:
        span_text = "".join(
            f":{span}{{{' '.join([f'{k}={_plain_value(v)}' for k, v in fields.items() if v is not None])}}}"
            for span, fields in line.spans
        )
        text = (
            f"{_timestamp(line.created)}\t{_level_name(line.levelno)}\t{_target(line.name)}{span_text}\t"
            f"{_quote(line.message)}"
        )
        rendered = [
            f"{key}={_plain_value(value)}" if key else _plain_run(cast(FieldRun, value))
            for key, value in line.items
        ]
        if "" in rendered:  # empty runs
            rendered = [r for r in rendered if r]
        if not rendered:
            return text
        return text + "\t" + " ".join(rendered)


# Runs rendered in the plain format, kept (a node's lines repeat a few pairs of workloads).
_PLAIN_RUNS: dict[FieldRun, str] = {}
_RUNS_KEPT = 1024


def _plain_run(run: FieldRun) -> str:
    text = _PLAIN_RUNS.get(run)
    if text is None:
        text = " ".join([f"{key}={_plain_value(value)}" for key, value in run])
        if len(_PLAIN_RUNS) >= _RUNS_KEPT:
            _PLAIN_RUNS.clear()
        _PLAIN_RUNS[run] = text
    return text


def _plain_value(value: object) -> str:
    kind = type(value)  # the common kinds first
    if kind is Bare:
        return cast(str, value)
    if kind is str:
        return _quote(cast(str, value))
    if kind is int:
        return str(value)
    bare = _bare_text(value)
    return bare if bare is not None else _quote(str(value))


class JsonFormatter(LineFormatter):
    """One JSON object per line: level, time, scope, message, the fields, then one object per span."""

    def line(self, line: Line) -> str:
        obj: dict[str, Any] = {
            "level": _level_name(line.levelno),
            "time": _timestamp(line.created),
            "scope": _target(line.name),
            "message": line.message,
        }
        for key, value in _flat(line.items):
            obj[key] = _json_value(value)
        for span, fields in line.spans:
            obj[span] = {k: _json_value(v) for k, v in fields.items() if v is not None}
        return json.dumps(obj, ensure_ascii=False)


def _json_value(value: object) -> object:
    if isinstance(value, bool | int | float) and not isinstance(value, Bare):
        return value
    bare = _bare_text(value)
    return bare if bare is not None else str(value)
