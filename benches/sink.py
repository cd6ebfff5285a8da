"""The harness's sink: the application behind every mode, in its own process.

Two listeners on the server workload's address:

* echo: writes back whatever arrives; an EOF from the client is answered with an EOF once the
  echo is flushed (so a half-closing client reads everything back);
* discard: counts what arrives and, at the client's EOF, answers with the count as 8 bytes
  (big endian) and closes. The generator compares the count with what it sent.

It runs on uvloop, with plain protocols (no streams), so its own cost per byte and per message
is as small as Python allows and identical in every mode. It prints `ready` once both listen.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import signal
import sys
from typing import cast

import uvloop

WRITE_HIGH_WATER = 4 * 1024 * 1024


class Echo(asyncio.Protocol):
    __slots__ = ("transport",)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)

    def eof_received(self) -> bool:
        return False  # close once the echo is flushed: the client sees our EOF after the data

    # An echo whose client does not read must stop reading too, or it buffers without bound.
    def pause_writing(self) -> None:
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()


class Discard(asyncio.Protocol):
    __slots__ = ("count", "transport")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.count = 0

    def data_received(self, data: bytes) -> None:
        self.count += len(data)

    def eof_received(self) -> bool:
        self.transport.write(self.count.to_bytes(8, "big"))
        return False


async def serve(host: str, echo_port: int, discard_port: int) -> None:
    loop = asyncio.get_running_loop()
    servers = [
        await loop.create_server(Echo, host, echo_port, backlog=4096, reuse_address=True),
        await loop.create_server(Discard, host, discard_port, backlog=4096, reuse_address=True),
    ]
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for s in servers:
        s.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benches.sink")
    parser.add_argument("--host", required=True)
    parser.add_argument("--echo-port", type=int, required=True)
    parser.add_argument("--discard-port", type=int, required=True)
    args = parser.parse_args(argv)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        uvloop.run(serve(args.host, args.echo_port, args.discard_port))
    except OSError as e:
        print(f"sink: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
