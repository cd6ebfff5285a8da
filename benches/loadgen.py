"""The harness's load generator: a process of its own, driven by the harness over stdin/stdout.

It reads one JSON command per line and answers each with one JSON line. It runs apart from the
harness (which only orchestrates and reads /proc) and apart from the proxies, so it never shares a
process, a GIL or an event loop with what it measures; on a small machine it still shares the
cores, equally in every mode, `direct` included, which is why every figure is read as a ratio to
`direct` from the same round.

How it reaches the sink is an `entry`: `{"kind": "direct", "echo": [host, port], "discard": [...]}`
connects straight to those addresses (the sink itself, or stunnel's client end); `{"kind":
"socks5", "proxy": [host, port], ...}` goes through a ztunnel's SOCKS5 listener with `echo` and
`discard` as the CONNECT targets. The SOCKS5 greeting, the CONNECT request and the first payload
byte are sent in one write (the proxy keeps bytes that follow the request), so a new connection
costs the client one round trip, as with a TLS tunnel whose client end is a plain TCP listener.
An entry may also name the C tools (`"tools": path`, `benches/tools.c`), which then run the
round trips and the connection loops, and an iperf3 server (`"iperf3": [host, port]`), which then
takes the throughput runs: in the capture topology the generator runs inside the client's network
namespace and these do the per-byte and per-connection work in C.

Commands (each bounded in count and time):

* `throughput {entry, streams, seconds, chunk}`: each stream writes `chunk`-sized buffers to the
  discard port until the deadline, half-closes and reads the sink's byte count; the rate is the sum
  of the counts over the time until the last count arrived;
* `rr {entry, seconds, max_count}`: one connection to the echo port, 1-byte request, 1-byte
  response, again; blocking sockets, so the generator's own cost per round trip is a few µs;
* `connrate {entry, seconds, concurrency, max_count}`: `concurrency` clients each loop on
  connect, 1 byte, read its echo, close;
* `paced {entry, rate, seconds, connections, size}`: the C tools' open-loop load (capture topology
  only): `rate` requests/s in all over `connections` persistent connections, `size` bytes each way,
  latency from each request's intended send time;
* `hold {entry, count, concurrency}` / `release`: open `count` connections (each proven end to end
  by a 1-byte echo) and keep them idle until `release`;
* `integrity {entry, streams, size}`: random bytes through the echo port on `streams` connections
  at once, SHA-256 of what was sent and of what came back;
* `concurrent {entry, count, size, keep}`: `count` connections open at once, each echoing `size`
  bytes of its own when opened and again once all are open, every byte compared; with `keep` they
  stay open until `release`;
* `soak_start {entry, streams, stream_rate, churn_rate, idle}` / `soak_stats` / `soak_stop`: the
  soak's mix in the background (echoing streams at a bounded rate, a bounded churn of short
  connections, idle held connections probed now and then), with its counters;
* `quit`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import uvloop

from benches.entry import Address, Entry, blocking_open, open_socket, recv_exactly, sock_recv_exactly
from benches.soakload import Soak


def _run_tool(argv: list[str], timeout: float) -> dict[str, Any]:
    """Runs a C tool (or iperf3) and returns the JSON it printed; its failure as an exception."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    try:
        result: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise ConnectionError(
            f"{os.path.basename(argv[0])} exited {done.returncode}: {done.stderr.strip()[-500:]}"
        ) from None
    if "error" in result:
        raise ConnectionError(f"{os.path.basename(argv[0])}: {result['error']}")
    return result


def run_rr(entry: Entry, seconds: float, max_count: int) -> dict[str, Any]:
    if entry.tools is not None and entry.kind == "direct":
        host, port = entry.echo
        return _run_tool([entry.tools, "rr", host, str(port), str(seconds), str(max_count)], seconds + 30)
    sock = blocking_open(entry, entry.echo)
    try:
        for _ in range(50):  # warm-up: the first round trips pay for lazy set-up on the path
            sock.sendall(b"x")
            recv_exactly(sock, 1)
        lat: list[int] = []
        clock = time.perf_counter_ns
        start = clock()
        deadline = start + int(seconds * 1e9)
        send, recv = sock.send, sock.recv
        now = start
        while len(lat) < max_count and now < deadline:
            send(b"x")
            if recv(1) != b"x":
                raise ConnectionError("echo mismatch or connection closed")
            t = clock()
            lat.append(t - now)
            now = t
        elapsed = (now - start) / 1e9
    finally:
        sock.close()
    lat.sort()
    n = len(lat)
    return {
        "count": n,
        "seconds": elapsed,
        "per_s": n / elapsed if elapsed > 0 else 0.0,
        "p50_us": lat[n // 2] / 1000 if n else None,
        "p99_us": lat[min(n - 1, (n * 99) // 100)] / 1000 if n else None,
        "mean_us": sum(lat) / n / 1000 if n else None,
    }


def run_paced(entry: Entry, rate: float, seconds: float, connections: int, size: int) -> dict[str, Any]:
    if entry.tools is None or entry.kind != "direct":
        raise ValueError("paced runs in the C tools only: the capture topology")
    host, port = entry.echo
    argv = [entry.tools, "paced", host, str(port), str(rate), str(seconds), str(connections), str(size)]
    return _run_tool(argv, seconds + 60)


class _Blaster(asyncio.Protocol):
    """Writes `chunk` until told to stop, then half-closes and reads the sink's 8-byte count."""

    def __init__(self, chunk: bytes) -> None:
        self.chunk = chunk
        self.sent = 0
        self.reply = bytearray()
        self.paused = False
        self.stopping = False
        self.done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=2 * len(self.chunk))

    def start(self) -> None:
        self._fill()

    def stop(self) -> None:
        self.stopping = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write_eof()

    def _fill(self) -> None:
        t = self.transport
        if t is None or self.stopping:
            return
        # Bounded per call, so a sink that swallows everything at once cannot starve the timer.
        for _ in range(64):
            if self.paused or self.stopping:
                return
            t.write(self.chunk)
            self.sent += len(self.chunk)
        asyncio.get_running_loop().call_soon(self._fill)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._fill()

    def data_received(self, data: bytes) -> None:
        self.reply += data
        if len(self.reply) >= 8 and not self.done.done():
            self.done.set_result(int.from_bytes(self.reply[:8], "big"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError("closed before the sink's count"))


async def run_iperf3(server: Address, streams: int, seconds: float) -> dict[str, Any]:
    """iperf3's client against `server`: the rate is the bytes the server received over its time."""
    # iperf3 takes whole seconds.
    argv = ["iperf3", "-c", server[0], "-p", str(server[1]), "-P", str(streams)]
    argv += ["-t", str(max(1, round(seconds))), "-J"]
    result = await asyncio.get_running_loop().run_in_executor(None, _run_tool, argv, seconds + 60)
    end = result["end"]
    received, sent = end["sum_received"], end["sum_sent"]
    total = int(received["bytes"])
    return {
        "bytes": total,
        "seconds": float(received["seconds"]),
        "bytes_per_s": total / float(received["seconds"]),
        # A TCP stream cannot gain bytes; iperf3 stops counting at its deadline, so fewer is normal.
        "intact": 0 < total <= int(sent["bytes"]),
        "sent": [int(sent["bytes"])],
        "received": [total],
        "tool": "iperf3",
    }


async def run_throughput(entry: Entry, streams: int, seconds: float, chunk_size: int) -> dict[str, Any]:
    if entry.iperf3 is not None:
        return await run_iperf3(entry.iperf3, streams, seconds)
    loop = asyncio.get_running_loop()
    chunk = os.urandom(chunk_size)
    blasters: list[_Blaster] = []
    try:
        for _ in range(streams):
            sock = await open_socket(entry, entry.discard)
            b = _Blaster(chunk)
            await loop.create_connection(lambda b=b: b, sock=sock)  # type: ignore[misc]
            blasters.append(b)
        t0 = loop.time()
        for b in blasters:
            b.start()

        def stop_all() -> None:
            for b in blasters:
                b.stop()

        stop = loop.call_at(t0 + seconds, stop_all)
        try:
            counts = await asyncio.wait_for(asyncio.gather(*(b.done for b in blasters)), seconds + 60)
        finally:
            stop.cancel()
        elapsed = loop.time() - t0
    finally:
        for b in blasters:
            if b.transport is not None:
                b.transport.close()
    sent = [b.sent for b in blasters]
    total = sum(counts)
    return {
        "bytes": total,
        "seconds": elapsed,
        "bytes_per_s": total / elapsed,
        "intact": list(counts) == sent,
        "sent": sent,
        "received": list(counts),
    }


async def _bounded(
    seconds: float, max_count: int, concurrency: int, one: Callable[[], Awaitable[None]]
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = t0 + seconds
    done = 0
    errors = 0
    first_error = ""

    async def worker() -> None:
        nonlocal done, errors, first_error
        while loop.time() < deadline and done + errors < max_count:
            try:
                await one()
                done += 1
            except OSError as e:
                errors += 1
                first_error = first_error or repr(e)
                if errors > max(10, done // 10):
                    return

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = loop.time() - t0
    return {
        "count": done,
        "errors": errors,
        "first_error": first_error,
        "seconds": elapsed,
        "per_s": done / elapsed,
    }


async def run_connrate(entry: Entry, seconds: float, concurrency: int, max_count: int) -> dict[str, Any]:
    if entry.tools is not None and entry.kind == "direct":
        host, port = entry.echo
        argv = [entry.tools, "connrate", host, str(port), str(seconds), str(concurrency), str(max_count)]
        return await asyncio.get_running_loop().run_in_executor(None, _run_tool, argv, seconds + 60)

    async def one() -> None:
        sock = await open_socket(entry, entry.echo, b"x")
        try:
            if await sock_recv_exactly(sock, 1) != b"x":
                raise ConnectionError("echo mismatch")
        finally:
            sock.close()

    # Warm-up: the pool (or whatever the path keeps) is set up before the clock starts.
    for _ in range(3):
        await one()
    return await _bounded(seconds, max_count, concurrency, one)


class Generator:
    def __init__(self) -> None:
        self.held: list[socket.socket] = []

    async def hold(self, entry: Entry, count: int, concurrency: int) -> dict[str, Any]:
        sem = asyncio.Semaphore(concurrency)
        errors = 0

        async def one() -> None:
            nonlocal errors
            async with sem:
                try:
                    sock = await open_socket(entry, entry.echo, b"x")
                except OSError:
                    errors += 1
                    return
                self.held.append(sock)
                try:
                    if await sock_recv_exactly(sock, 1) != b"x":
                        errors += 1
                except OSError:
                    errors += 1

        await asyncio.wait_for(asyncio.gather(*(one() for _ in range(count))), 120 + count / 100)
        return {"held": len(self.held), "errors": errors}

    def release(self) -> dict[str, Any]:
        n = len(self.held)
        for s in self.held:
            s.close()
        self.held.clear()
        return {"released": n}


async def run_integrity(entry: Entry, streams: int, size: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    payload = os.urandom(size * streams)

    async def one(i: int) -> tuple[str, str, int]:
        data = memoryview(payload)[i * size : (i + 1) * size]
        sock = await open_socket(entry, entry.echo)
        try:

            async def send() -> None:
                await loop.sock_sendall(sock, data)
                if entry.half_close:
                    sock.shutdown(socket.SHUT_WR)

            sender = asyncio.ensure_future(send())
            h = hashlib.sha256()
            n = 0
            # With a half-close, read to the EOF (the path must carry it back after the data);
            # without, exactly what was sent.
            while entry.half_close or n < size:
                chunk = await loop.sock_recv(sock, 1 << 20)
                if not chunk:
                    break
                h.update(chunk)
                n += len(chunk)
            await sender
            return hashlib.sha256(data).hexdigest(), h.hexdigest(), n
        finally:
            sock.close()

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(streams))), 60)
    return {
        "ok": all(s == r for s, r, _ in results) and all(n == size for _, _, n in results),
        "bytes": size * streams,
        "sent_sha256": [s for s, _, _ in results],
        "received_sha256": [r for _, r, _ in results],
    }


async def run_concurrent(
    entry: Entry, count: int, size: int, keep: list[socket.socket] | None = None
) -> dict[str, Any]:
    """`count` connections open at the same time, every byte of each compared, twice: when it opens
    and again once all are open (so every one is proven while the others are held). With `keep`,
    they stay open, added to it (`release` closes them)."""
    sem = asyncio.Semaphore(256)  # opening rate only; they all stay open together
    socks: list[socket.socket] = []
    errors: list[str] = []
    mismatched = 0

    async def echo(sock: socket.socket, data: bytes) -> bool:
        await asyncio.get_running_loop().sock_sendall(sock, data)
        return await sock_recv_exactly(sock, len(data)) == data

    async def open_one() -> None:
        nonlocal mismatched
        async with sem:
            data = os.urandom(size)
            try:
                sock = await open_socket(entry, entry.echo)
            except OSError as e:
                errors.append(repr(e))
                return
            socks.append(sock)
            try:
                if not await echo(sock, data):
                    mismatched += 1
            except OSError as e:
                errors.append(repr(e))

    async def again(sock: socket.socket) -> None:
        nonlocal mismatched
        async with sem:
            try:
                if not await echo(sock, os.urandom(size)):
                    mismatched += 1
            except OSError as e:
                errors.append(repr(e))

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        await asyncio.wait_for(asyncio.gather(*(open_one() for _ in range(count))), 300)
        opened = loop.time() - t0
        held = len(socks)
        await asyncio.wait_for(asyncio.gather(*(again(s) for s in socks)), 300)
    finally:
        if keep is not None:
            keep.extend(socks)
        else:
            for s in socks:
                s.close()
    return {
        "count": count,
        "held": held,
        "bytes_verified": 2 * size * held if not errors and not mismatched else None,
        "mismatched": mismatched,
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        "open_seconds": opened,
        "seconds": loop.time() - t0,
        "ok": held == count and not errors and not mismatched,
    }


async def serve_commands() -> None:
    loop = asyncio.get_running_loop()
    gen = Generator()
    soak: Soak | None = None
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": True}), flush=True)
    while line := await reader.readline():
        cmd = json.loads(line)
        name = cmd.get("cmd")
        try:
            entry = Entry.from_json(cmd["entry"]) if "entry" in cmd else None
            if name == "quit":
                gen.release()
                print(json.dumps({"bye": True}), flush=True)
                return
            if name == "release":
                result = gen.release()
            elif name in ("soak_stats", "soak_stop"):
                if soak is None:
                    raise ValueError("no soak is running")
                result = soak.stats() if name == "soak_stats" else await soak.stop()
                if name == "soak_stop":
                    soak = None
            elif entry is None:
                raise ValueError(f"command {name!r} needs an entry")
            elif name == "throughput":
                result = await run_throughput(
                    entry, cmd["streams"], cmd["seconds"], cmd.get("chunk", 256 * 1024)
                )
            elif name == "rr":
                result = run_rr(entry, cmd["seconds"], cmd["max_count"])
            elif name == "connrate":
                result = await run_connrate(entry, cmd["seconds"], cmd["concurrency"], cmd["max_count"])
            elif name == "paced":
                result = run_paced(entry, cmd["rate"], cmd["seconds"], cmd["connections"], cmd["size"])
            elif name == "hold":
                result = await gen.hold(entry, cmd["count"], cmd.get("concurrency", 64))
            elif name == "integrity":
                result = await run_integrity(entry, cmd["streams"], cmd["size"])
            elif name == "concurrent":
                keep = gen.held if cmd.get("keep") else None
                result = await run_concurrent(entry, cmd["count"], cmd.get("size", 64), keep)
            elif name == "soak_start":
                if soak is not None:
                    raise ValueError("a soak is already running")
                soak = Soak(entry, cmd["streams"], cmd["stream_rate"], cmd["churn_rate"], cmd["idle"])
                result = {"started": True}
            else:
                raise ValueError(f"unknown command {name!r}")
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(result), flush=True)


def main() -> int:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    uvloop.run(serve_commands())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
