"""The development control plane checks callers as istiod does, when asked to (`--auth-token`,
`--cluster-id`): the proxy's own CA and xDS clients get through with the token and cluster id, and
a call without them, or with others, is refused with UNAUTHENTICATED and a reason, and logged.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from controlplane.server import ControlPlane, ControlPlaneStartError
from hbone.identity import Identity
from xds.channel import AuthToken
from xds.gen.envoy.service.discovery.v3 import discovery_pb2, discovery_pb2_grpc
from ztunnel.identity.caclient import GrpcCaClient
from ztunnel.identity.certificates import CaError

TOKEN = "header.payload.signature"
CLUSTER = "cluster-east"
IDENTITY = Identity.parse("spiffe://cluster.local/ns/default/sa/client")
ADDRESS_TYPE = "type.googleapis.com/istio.workload.Address"


@pytest.fixture
async def control_plane(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> AsyncIterator[ControlPlane]:
    caplog.set_level(logging.INFO, logger="controlplane")
    config = tmp_path / "mesh.yaml"
    config.write_text("workloads: []\n")
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    cp = ControlPlane(
        config, listen="127.0.0.1:0", ca_dir=tmp_path / "ca", auth_token=token, cluster_id=CLUSTER
    )
    await cp.start()
    try:
        yield cp
    finally:
        await cp.stop(grace=0)


def ca_client(cp: ControlPlane, token: str | None, cluster: str = CLUSTER) -> GrpcCaClient:
    return GrpcCaClient(
        cp.address,
        token=AuthToken(value=token) if token is not None else None,
        cluster_id=cluster,
        call_timeout=5,
    )


async def test_the_right_token_and_cluster_get_a_certificate(control_plane: ControlPlane) -> None:
    client = ca_client(control_plane, TOKEN)
    try:
        cert = await client.fetch(IDENTITY)
    finally:
        await client.close()
    assert cert.identity == IDENTITY


@pytest.mark.parametrize(
    ("token", "cluster", "reason"),
    [
        (None, CLUSTER, "no authorization header (expected a bearer token)"),
        ("someone.else.s", CLUSTER, "bearer token is not valid"),
        (TOKEN, "Kubernetes", "clusterid 'Kubernetes' is not 'cluster-east'"),
    ],
)
async def test_other_callers_are_refused_with_a_reason(
    control_plane: ControlPlane,
    caplog: pytest.LogCaptureFixture,
    token: str | None,
    cluster: str,
    reason: str,
) -> None:
    client = ca_client(control_plane, token, cluster)
    try:
        with pytest.raises(CaError) as failure:
            await client.fetch(IDENTITY)
    finally:
        await client.close()
    assert f"refused the request: UNAUTHENTICATED: {reason}" in str(failure.value)
    assert any(
        r.getMessage() == f"refused /istio.v1.auth.IstioCertificateService/CreateCertificate: {reason}"
        for r in caplog.records
    )


async def test_an_xds_stream_needs_the_token_too(control_plane: ControlPlane) -> None:
    target = control_plane.address.removeprefix("http://")
    request = discovery_pb2.DeltaDiscoveryRequest(type_url=ADDRESS_TYPE)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = discovery_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        refused = stub.DeltaAggregatedResources(metadata=(("clusterid", CLUSTER),), timeout=5)
        await refused.write(request)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await refused.read()
        assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED

        allowed = stub.DeltaAggregatedResources(
            metadata=(("authorization", f"Bearer {TOKEN}"), ("clusterid", CLUSTER)), timeout=5
        )
        await allowed.write(request)
        response = await allowed.read()
        assert response.type_url == ADDRESS_TYPE
        allowed.cancel()


async def test_a_missing_token_file_stops_start_up(tmp_path: Path) -> None:
    config = tmp_path / "mesh.yaml"
    config.write_text("workloads: []\n")
    cp = ControlPlane(config, listen="127.0.0.1:0", ca_dir=tmp_path / "ca", auth_token=tmp_path / "nope")
    with pytest.raises(ControlPlaneStartError, match=r"--auth-token .*nope: no such file"):
        await cp.start()
