"""Shared fixtures. Proxies in tests log in the plain format, so failures show real log lines."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import uvloop

from ztunnel.logs import reset_logging, setup_logging


class LogLines(io.StringIO):
    def text(self) -> str:
        return self.getvalue()


@pytest.fixture
def proxy_logs() -> Iterator[LogLines]:
    """What the proxies log (plain format, debug), as a user reading their output would see it."""
    stream = LogLines()
    setup_logging("plain", "debug", stream=stream)
    try:
        yield stream
    finally:
        print(stream.getvalue())
        reset_logging()


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """Tests run on uvloop, the loop the proxy runs on (its transports differ from asyncio's)."""
    return {"uvloop": uvloop.new_event_loop}
