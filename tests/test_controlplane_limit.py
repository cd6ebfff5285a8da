"""The development control plane takes at most 4 MiB in one gRPC message, as istiod does; istiod's
`ISTIO_GPRC_MAXRECVMSGSIZE` or `--max-recv-msg-size` raises it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from controlplane.server import (
    DEFAULT_MAX_RECV_MSG_SIZE,
    ControlPlane,
    ControlPlaneStartError,
    receive_limit,
)
from xds.gen.envoy.service.discovery.v3 import discovery_pb2, discovery_pb2_grpc

ADDRESS_TYPE = "type.googleapis.com/istio.workload.Address"
MIB = 1024 * 1024
WAIT = 10.0


def request_of(size: int) -> discovery_pb2.DeltaDiscoveryRequest:
    """An Address subscription of exactly `size` bytes, listing one resource with a long version."""
    request = discovery_pb2.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE)
    pad = size
    while True:
        request.initial_resource_versions["x"] = "v" * pad
        over = request.ByteSize() - size
        if over == 0:
            return request
        pad -= over


async def answer_to(address: str, size: int) -> grpc.StatusCode | str:
    """Send a request of `size` bytes: the type URL of the answer, or the status that ended the call."""
    async with grpc.aio.insecure_channel(
        address.removeprefix("http://"), options=[("grpc.max_send_message_length", 64 * MIB)]
    ) as channel:
        call = discovery_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources()
        await call.write(request_of(size))
        try:
            response = await call.read()
        except grpc.aio.AioRpcError as e:
            assert "larger than max" in (e.details() or ""), e.details()
            return e.code()
        finally:
            call.cancel()
        assert isinstance(response, discovery_pb2.DeltaDiscoveryResponse)
        return response.type_url


@pytest.fixture
def mesh(tmp_path: Path) -> Path:
    path = tmp_path / "mesh.yaml"
    path.write_text("workloads: []\n")
    return path


async def test_a_request_over_4_mib_is_refused_as_istiod_refuses_it(mesh: Path, tmp_path: Path) -> None:
    cp = ControlPlane(mesh, listen="127.0.0.1:0", ca_dir=tmp_path / "ca")
    await cp.start()
    try:
        assert await answer_to(cp.address, 4 * MIB) == ADDRESS_TYPE
        assert await answer_to(cp.address, 4 * MIB + 1) == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await cp.stop(grace=0)


async def test_a_raised_limit_takes_a_larger_request(mesh: Path, tmp_path: Path) -> None:
    cp = ControlPlane(mesh, listen="127.0.0.1:0", ca_dir=tmp_path / "ca", max_recv_msg_size=8 * MIB)
    await cp.start()
    try:
        assert await answer_to(cp.address, 6 * MIB) == ADDRESS_TYPE
        assert await answer_to(cp.address, 8 * MIB + 1) == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await cp.stop(grace=0)


def test_the_limit_is_the_flag_else_istiods_variable_else_4_mib() -> None:
    env = "ISTIO_GPRC_MAXRECVMSGSIZE"
    assert DEFAULT_MAX_RECV_MSG_SIZE == 4 * MIB
    assert receive_limit(None, {}) == 4 * MIB
    assert receive_limit(None, {env: "33554432"}) == 32 * MIB
    assert receive_limit("1000", {env: "33554432"}) == 1000
    for flag, environ, named in [
        ("0", {}, "--max-recv-msg-size '0'"),
        ("4MiB", {}, "--max-recv-msg-size '4MiB'"),
        ("4294967296", {}, "--max-recv-msg-size '4294967296'"),
        (None, {env: "-1"}, f"env var {env}=-1"),
        (None, {env: ""}, f"env var {env}="),
    ]:
        with pytest.raises(ControlPlaneStartError) as refused:
            receive_limit(flag, environ)
        assert str(refused.value) == f"invalid {named} (expected a number of bytes, 1 to 2147483647)"


def run_command(
    tmp_path: Path, mesh: Path, *args: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ztunnel", "control-plane", "--config", str(mesh), "--ca-dir", str(tmp_path / "ca"),
         "--listen", "127.0.0.1:0", *args],
        capture_output=True, text=True, timeout=30, env={**os.environ, **env},
    )  # fmt: skip


def test_a_bad_limit_stops_the_command_with_one_line(tmp_path: Path, mesh: Path) -> None:
    for args, env, expected in [
        (["--max-recv-msg-size", "big"], {}, "invalid --max-recv-msg-size 'big'"),
        ([], {"ISTIO_GPRC_MAXRECVMSGSIZE": "4M"}, "invalid env var ISTIO_GPRC_MAXRECVMSGSIZE=4M ("),
    ]:
        r = run_command(tmp_path, mesh, *args, env=env)
        assert r.returncode == 1
        assert r.stderr.count("\n") == 1 and expected in r.stderr, r.stderr
        assert r.stdout == ""


def test_the_command_says_how_to_raise_it() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ztunnel", "control-plane", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0
    assert "--max-recv-msg-size BYTES" in r.stdout
    assert "ISTIO_GPRC_MAXRECVMSGSIZE" in r.stdout and "4194304" in r.stdout


async def test_istiods_variable_raises_the_running_commands_limit(tmp_path: Path, mesh: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ztunnel", "control-plane", "--config", str(mesh), "--ca-dir", str(tmp_path / "ca"),
         "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "ISTIO_GPRC_MAXRECVMSGSIZE": str(8 * MIB)},
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        listening = await asyncio.to_thread(proc.stdout.readline)
        assert listening.startswith("control plane listening on http://"), listening
        address = listening.strip().rsplit(" ", 1)[1]
        assert await answer_to(address, 6 * MIB) == ADDRESS_TYPE
        assert await answer_to(address, 8 * MIB + 1) == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        proc.terminate()
        proc.wait(WAIT)
        proc.stdout.close()
