"""Shared fixtures. Proxies in tests log in the plain format, so failures show real log lines."""

from __future__ import annotations

import importlib
import io
import sys
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from types import ModuleType

import pytest
import uvloop

from tests.harness import Fleet
from ztunnel.logs.lines import reset_logging, setup_logging


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


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """The `ztunnel` processes this test starts through `tests/harness.py` (`await fleet.start(env,
    ...)`, `fleet.control_plane(...)`, ...); at the end each is stopped (SIGTERM, then SIGKILL to its
    whole process group) and none of its processes is left."""
    proxies = Fleet(tmp_path / "proxies")
    try:
        yield proxies
    finally:
        proxies.close()


@pytest.fixture(scope="module")
def module_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """`fleet` for processes a whole module shares (started once: `fleet.start_all(env, ...)`)."""
    proxies = Fleet(tmp_path_factory.mktemp("proxies"))
    try:
        yield proxies
    finally:
        proxies.close()


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """Tests run on uvloop, the loop the proxy runs on (its transports differ from asyncio's)."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def profile_pb2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """pprof's published `profile.proto` (vendored beside the code), compiled here with grpcio-tools."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("pprof_proto")
    proto_dir = Path(str(resources.files("ztunnel.admin"))).resolve()
    well_known = str(resources.files("grpc_tools") / "_proto")
    assert (
        protoc.main(["protoc", f"-I{proto_dir}", f"-I{well_known}", f"--python_out={out}", "profile.proto"])
        == 0
    )
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module("profile_pb2")
    finally:
        sys.path.remove(str(out))
        sys.modules.pop("profile_pb2", None)
