"""The log writer: a stderr nobody reads (a real pipe) never blocks an event loop; lines that do not
fit are dropped, counted (`ztunnel_log_lines_dropped_total`) and reported once the stream drains.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from tests.apps import echo_server, exchange, loopback_net, socks5
from tests.harness import Fleet, proxy_env
from tests.waiting import eventually, eventually_async
from ztunnel.logs import lines as logs
from ztunnel.logs.writer import LogWriter
from ztunnel.metrics.families import Metrics

pytestmark = pytest.mark.timeout(120)

LINES = 20_000
LINE = "x" * 200  # with the prefix, ~250 bytes a line: 5 MB in all, the pipe holds 64 KiB


def only_ours() -> None:
    """pytest's log capture off the root logger (it is added for each test's call): the lines
    reach our writer alone, as in a proxy."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if not isinstance(handler, logs.LineHandler):
            root.removeHandler(handler)


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    try:
        yield r, w
    finally:
        logs.reset_logging()
        for fd in (r, w):
            os.close(fd)


def read_until(fd: int, marker: bytes, timeout: float = 20, count: int = 1) -> bytes:
    """What the pipe gives until `count` lines containing `marker` have come."""
    got = bytearray()
    deadline = time.monotonic() + timeout
    os.set_blocking(fd, False)
    while got.count(marker) < count or not got.endswith(b"\n"):
        assert time.monotonic() < deadline, f"no {marker!r} after {len(got)} bytes"
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        got += chunk
    return bytes(got)


def scrape_dropped() -> float:
    body, _ = Metrics(process_metrics=False).render(None)
    m = re.search(rb"^ztunnel_log_lines_dropped_total (\S+)$", body, re.M)
    assert m is not None, body
    return float(m.group(1))


async def test_a_pipe_nobody_reads_never_blocks_the_loop(pipe: tuple[int, int]) -> None:
    r, w = pipe
    logs.setup_logging("plain", "info", fd=w)
    only_ours()
    log = logging.getLogger("ztunnel.proxy")
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)  # the ticker's period: what measures the loop
            lags.append(time.monotonic() - before - 0.01)

    task = asyncio.get_running_loop().create_task(ticker())
    started = time.monotonic()
    for i in range(LINES):
        log.info("%s %d", LINE, i)
        if i % 500 == 0:
            await asyncio.sleep(0)  # let the ticker measure the loop while the lines come
    took = time.monotonic() - started
    ticked = len(lags)
    await eventually_async(lambda: len(lags) > ticked, "a tick of the loop after the last line")
    task.cancel()
    # Logging 5 MB into a full pipe took no longer than logging it anywhere, and the loop kept turning.
    assert took < 5, took
    assert max(lags) < 0.5, max(lags)
    dropped = logs.dropped_lines()
    assert dropped > LINES // 2, dropped  # 1 MiB of buffer and the pipe's 64 KiB got through
    assert scrape_dropped() == dropped

    # Someone reads again: the buffered lines come, then one line saying how many were dropped.
    text = read_until(r, b"log lines dropped").decode()
    numbers = [int(m) for m in re.findall(rf'"{LINE} (\d+)"', text)]
    assert numbers == sorted(numbers) and numbers[0] == 0, "kept lines in order, from the first"
    report = text.splitlines()[-1]
    assert re.search(
        r'\twarn\tlogs\t"log lines dropped: the log stream was not read in time"\tdropped=(\d+)$', report
    )
    assert int(report.rsplit("=", 1)[1]) == dropped
    assert len(numbers) + dropped == LINES  # every line written or counted

    # And later lines flow again.
    log.info("after the drain")
    assert b"after the drain" in read_until(r, b"after the drain")
    assert logs.dropped_lines() == dropped


def test_a_reader_gone_costs_nothing_but_the_lines() -> None:
    r, w = os.pipe()
    os.close(r)  # writes now fail with EPIPE
    try:
        logs.setup_logging("plain", "info", fd=w)
        only_ours()
        log = logging.getLogger("ztunnel.proxy")
        started = time.monotonic()
        for i in range(2_000):
            log.info("to nobody %d", i)
        assert time.monotonic() - started < 2
        eventually(
            lambda: logs.dropped_lines() == 2_000, lambda: f"every line counted: {logs.dropped_lines()}"
        )
    finally:
        logs.reset_logging()
        os.close(w)


def test_a_forked_child_writes_its_own_lines(pipe: tuple[int, int]) -> None:
    r, w = pipe
    logs.setup_logging("plain", "info", fd=w)
    only_ours()
    logging.getLogger("ztunnel.start").info("parent before fork")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            logging.getLogger("ztunnel.start").info("child line")
            logging.shutdown()  # as a worker does before it exits: the buffer is written
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    text = read_until(r, b"child line").decode()
    assert text.count("parent before fork") == 1, text  # not written twice by the child


def test_writers_sharing_a_slow_pipe_never_interleave_within_a_line(pipe: tuple[int, int]) -> None:
    """A proxy's processes share one stderr: with the reader behind, each writer thread blocks in
    write(2) at once, and a write larger than the pipe's atomic size would be split between them,
    lines spliced into each other. Every line read whole, from either writer."""
    r, w = pipe
    writers = [LogWriter(w, limit=4 << 20) for _ in range(2)]
    for i in range(3000):
        for n, writer in enumerate(writers):
            writer.write(f"writer{n} line {i:05d} {'y' * 180} end\n")
    # A slow reader: a page at a time, so that both writers wait for room again and again.
    got = bytearray()
    deadline = time.monotonic() + 60
    while got.count(b"\n") < 6000:
        assert time.monotonic() < deadline, len(got)
        got += os.read(r, 4096)
        time.sleep(0.001)  # the reader's slowness: the stimulus
    for writer in writers:
        assert writer.flush()
        writer.close()
    lines = got.decode().splitlines()
    spliced = [line for line in lines if not re.fullmatch(r"writer[01] line \d{5} y{180} end", line)]
    assert not spliced, spliced[:3]
    assert len(lines) == 6000 and all(writer.dropped == 0 for writer in writers)


# -- a proxy whose stderr nobody reads ---------------------------------------------------------------


def test_a_proxy_with_a_stderr_nobody_reads_keeps_carrying_connections(fleet: Fleet) -> None:
    net = loopback_net()
    ip, app = f"{net}.2", f"{net}.9"
    mesh = f'workloads:\n  - uid: k//v1/Pod/demo/client\n    name: client\n    namespace: demo\n    serviceAccount: client\n    workloadIps: ["{ip}"]\n    protocol: HBONE\n'
    r, w = os.pipe()
    proxy = fleet.proxy(proxy_env(ip, "demo/client/client", mesh, LOG_LEVEL="debug"), output=w)
    proxy.spawn()
    os.close(w)
    try:
        with echo_server(app, 8080):
            started = time.monotonic()
            # Start-up logs less than the pipe holds; wait for readiness without reading the pipe.
            proxy.wait_ready(timeout=45)
            # 400 connections, ~2 KB of log lines each at debug: three times what the pipe holds,
            # so a proxy writing to it directly would stop at the pipe's 64 KiB.
            for i in range(400):
                with socks5(ip, app, 8080, timeout=5) as s:
                    assert exchange(s, f"n{i}".encode()) == f"n{i}".encode()
            assert time.monotonic() - started < 60
        # The workers' buffers held the rest: once read, every access line is there, none dropped.
        text = read_until(r, b"connection complete", count=400).decode(errors="replace")
        assert "log lines dropped" not in text
    finally:
        if proxy.running():
            threading.Thread(target=lambda: _drain(r), daemon=True).start()
            proxy.terminate(signal.SIGTERM, timeout=20)
        os.close(r)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 1 << 16):
            pass
    except OSError:
        pass
