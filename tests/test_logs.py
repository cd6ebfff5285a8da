"""Log lines as a user reads them (plain and JSON), and the level filter."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from ztunnel.logs import lines as logs
from ztunnel.logs.lines import (
    Bare,
    access_log,
    current_filter,
    log_fields,
    parse_filter,
    set_filter,
    setup_logging,
)

TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z"

COMPLETE = {
    "src.addr": ("10.1.0.7", 51234),
    "src.workload": "client-5d9c",
    "src.namespace": "demo",
    "src.identity": "spiffe://cluster.local/ns/demo/sa/client-sa",
    "src.cluster": None,
    "dst.addr": Bare("10.1.0.9:15008"),
    "dst.hbone_addr": ("10.1.0.9", 8080),
    "dst.service": "server.demo.svc.cluster.local",
    "dst.workload": "server-7f4b",
    "dst.namespace": "demo",
    "dst.identity": "spiffe://cluster.local/ns/demo/sa/server-sa",
    "direction": "outbound",
    "bytes_sent": 512,
    "bytes_recv": 2048,
    "duration": "12ms",
}


@pytest.fixture
def out() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    yield stream
    logs.reset_logging()


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_plain_access_log_line(out: io.StringIO) -> None:
    setup_logging("plain", "info", out)
    access_log(logging.INFO, "connection complete", COMPLETE)
    [line] = lines(out)
    assert re.fullmatch(TIME, line.split("\t")[0])
    assert line.split("\t", 1)[1] == (
        'info\taccess\t"connection complete"\t'
        'src.addr=10.1.0.7:51234 src.workload="client-5d9c" src.namespace="demo" '
        'src.identity="spiffe://cluster.local/ns/demo/sa/client-sa" dst.addr=10.1.0.9:15008 '
        'dst.hbone_addr=10.1.0.9:8080 dst.service="server.demo.svc.cluster.local" dst.workload="server-7f4b" '
        'dst.namespace="demo" dst.identity="spiffe://cluster.local/ns/demo/sa/server-sa" '
        'direction="outbound" bytes_sent=512 bytes_recv=2048 duration="12ms"'
    )


def test_plain_escaping_ipv6_and_no_fields(out: io.StringIO) -> None:
    setup_logging("plain", "debug", out)
    access_log(
        logging.ERROR,
        "connection complete",
        {"src.addr": ("::1", 80), "error": 'http status: 503 "busy"\nretry', "ok": False},
    )
    logging.getLogger("ztunnel.proxy.inbound").warning("listener %s stopped", "inbound")
    first, second = lines(out)
    assert first.split("\t", 1)[1] == (
        'error\taccess\t"connection complete"\tsrc.addr=[::1]:80 error="http status: 503 \\"busy\\"\\nretry" ok=false'
    )
    assert second.split("\t", 1)[1] == 'warn\tproxy.inbound\t"listener inbound stopped"'


def test_exception_stays_on_one_line(out: io.StringIO) -> None:
    setup_logging("plain", "info", out)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("ztunnel.xds").exception("stream failed")
    [line] = lines(out)
    assert line.split("\t")[1:4] == ["error", "xds", '"stream failed"']
    assert "RuntimeError: boom" in line


def test_json_access_log_line(out: io.StringIO) -> None:
    setup_logging("json", "info", out)
    access_log(logging.INFO, "connection complete", COMPLETE)
    [line] = lines(out)
    obj = json.loads(line)
    assert list(obj)[:4] == ["level", "time", "scope", "message"]
    assert re.fullmatch(TIME, obj["time"])
    assert obj["level"] == "info"
    assert obj["scope"] == "access"
    assert obj["message"] == "connection complete"
    assert obj["src.addr"] == "10.1.0.7:51234"
    assert obj["dst.addr"] == "10.1.0.9:15008"
    assert obj["bytes_sent"] == 512
    assert obj["duration"] == "12ms"
    assert "src.cluster" not in obj
    assert list(obj)[4:] == [k for k, v in COMPLETE.items() if v is not None]


def test_disabled_levels_are_not_emitted(out: io.StringIO) -> None:
    setup_logging("plain", "info", out)
    access_log(logging.DEBUG, "connection opened", {"src.addr": ("1.2.3.4", 5)})
    log_fields(logging.getLogger("ztunnel.proxy"), logs.TRACE, "chunk", {"n": 1})
    assert out.getvalue() == ""


def test_per_target_levels(out: io.StringIO) -> None:
    setup_logging("plain", "warn,access=debug,ztunnel::proxy=off", out)
    access_log(logging.DEBUG, "connection opened", {})
    logging.getLogger("ztunnel.xds").info("hidden")
    logging.getLogger("ztunnel.xds").warning("shown")
    logging.getLogger("ztunnel.proxy.outbound").error("silenced")
    assert [line.split("\t")[2:4] for line in lines(out)] == [
        ["access", '"connection opened"'],
        ["xds", '"shown"'],
    ]


def test_trace_level_name(out: io.StringIO) -> None:
    setup_logging("plain", "trace", out)
    logging.getLogger("hbone.pool").log(logs.TRACE, "detail")
    [line] = lines(out)
    assert line.split("\t")[1:3] == ["trace", "hbone.pool"]


def test_parse_filter() -> None:
    assert parse_filter("info") == logs.LogFilter("info")
    assert parse_filter("info,access=debug") == logs.LogFilter("info", (("access", "debug"),))
    assert parse_filter("ztunnel::proxy=WARN, error") == logs.LogFilter("error", (("ztunnel.proxy", "warn"),))
    assert str(parse_filter("access=debug")) == "info,access=debug"


@pytest.mark.parametrize("spec", ["", ",", "loud", "access=loud", "=debug", "a=b=debug", "info,[span]=debug"])
def test_parse_filter_errors(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_filter(spec)


def test_set_filter_appends_and_resets(out: io.StringIO) -> None:
    setup_logging("plain", "info,access=debug", out)
    assert current_filter() == "info,access=debug"
    assert set_filter("ztunnel::xds=trace", reset=False) == "info,access=debug,ztunnel.xds=trace"
    assert set_filter("warn", reset=False) == "warn,access=debug,ztunnel.xds=trace"
    assert current_filter() == "warn,access=debug,ztunnel.xds=trace"
    logging.getLogger("ztunnel.state").info("hidden now")
    logging.getLogger("ztunnel.xds").log(logs.TRACE, "visible")
    assert set_filter("", reset=True) == "info,access=debug"
    logging.getLogger("ztunnel.xds").debug("hidden again")
    assert set_filter("debug", reset=True) == "debug,access=debug"
    assert [line.split("\t")[3] for line in lines(out)] == ['"visible"']


@pytest.mark.parametrize("spec", ["", "loud", "access=nope"])
def test_set_filter_errors_keep_the_filter(out: io.StringIO, spec: str) -> None:
    setup_logging("plain", "info", out)
    with pytest.raises(ValueError):
        set_filter(spec, reset=False)
    assert current_filter() == "info"


def test_setup_rejects_bad_format(out: io.StringIO) -> None:
    with pytest.raises(ValueError, match="log format"):
        setup_logging("xml", "info", out)


@pytest.mark.parametrize(
    "text",
    [
        "plain",
        "",
        "tab\there",
        'quote " inside',
        "back\\slash",
        "ünïcode ✓",
        "line\u2028sep",
        "\x7f",
        "nul\x00",
    ],
)
def test_quoted_values_are_json_strings(out: io.StringIO, text: str) -> None:
    """Whatever a value holds, the plain line quotes it as a JSON string: it reads back unchanged."""
    setup_logging("plain", "info", out)
    access_log(logging.INFO, "m", {"v": text})
    [line] = out.getvalue().split("\n")[:-1]
    quoted = line.split("\t", 4)[4].removeprefix("v=")
    assert json.loads(quoted) == text
    assert "\n" not in quoted and "\t" not in quoted


def test_timestamps_are_utc_microseconds(out: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    setup_logging("plain", "info", out)
    for t in (1_780_000_000.000001, 1_780_000_000.999999, 1_780_000_001.5):
        monkeypatch.setattr("time.time", lambda t=t: t)
        monkeypatch.setattr("time.time_ns", lambda t=t: int(t * 1e9))
        logging.getLogger("ztunnel.x").warning("tick")
    stamps = [line.split("\t")[0] for line in lines(out)]
    assert stamps == [
        "2026-05-28T20:26:40.000001Z",
        "2026-05-28T20:26:40.999999Z",
        "2026-05-28T20:26:41.500000Z",
    ]


@pytest.mark.parametrize("fmt", ["plain", "json"])
def test_access_lines_are_the_same_with_and_without_other_handlers(out: io.StringIO, fmt: str) -> None:
    """With our handler alone the access log skips the record machinery; another handler on the
    root (a test's capture, an embedding app's) gets records, and both ways print the same line."""
    setup_logging(fmt, "info", out)
    access_log(logging.INFO, "connection complete", COMPLETE, (("outbound", {"id": "ab"}),))
    other = io.StringIO()
    extra = logging.StreamHandler(other)
    logging.getLogger().addHandler(extra)
    try:
        access_log(logging.INFO, "connection complete", COMPLETE, (("outbound", {"id": "ab"}),))
    finally:
        logging.getLogger().removeHandler(extra)
    direct, via_record = lines(out)
    assert other.getvalue()  # the record reached the other handler
    strip = (
        (lambda line: line.split("\t", 1)[1])
        if fmt == "plain"
        else (lambda line: {**json.loads(line), "time": ""})
    )
    assert strip(direct) == strip(via_record)
