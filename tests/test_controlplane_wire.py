"""The development control plane's responses as written on the wire: each resource encoded once,
when the snapshot is built, and a response put together from those bytes."""

from __future__ import annotations

from controlplane.snapshot import Delta, encode_response, snapshot_from_config
from mesh.localconfig import parse_local_config
from xds.gen.envoy.service.discovery.v3 import discovery_pb2

ADDRESS_TYPE = "type.googleapis.com/istio.workload.Address"


def test_a_response_is_encoded_as_protobuf_would_encode_it() -> None:
    """Responses are written from each resource's kept bytes: the same message as built by protobuf,
    aliases, removals and resources of every length (one-, two- and three-byte lengths) included."""
    big = "\n".join(
        f"  - {{uid: w{i}, namespace: demo, workloadIps: ['10.0.{i}.1'], name: {'n' * 9000 * i}}}"
        for i in range(3)
    )
    snapshot = snapshot_from_config(parse_local_config("workloads:\n" + big + "\n"))
    delta = snapshot.delta_since(ADDRESS_TYPE, {"gone": "1"})
    delta = Delta(delta.type_url, delta.updated, delta.removed, {"w1": ("demo/w1.example", "/10.0.1.1")})
    decoded = discovery_pb2.DeltaDiscoveryResponse.FromString(encode_response(delta, "7"))
    expected = discovery_pb2.DeltaDiscoveryResponse(
        type_url=ADDRESS_TYPE,
        nonce="7",
        removed_resources=["gone"],
        resources=[
            discovery_pb2.Resource(
                name=r.name,
                version=r.version,
                resource=r.resource,
                aliases=list(delta.aliases.get(r.name, ())),
            )
            for r in delta.updated
        ],
    )
    assert decoded == expected and len(decoded.resources) == 3
    assert [len(r.SerializeToString()) > 16384 for r in decoded.resources] == [False, False, True]
    assert decoded.resources[1].aliases == ["demo/w1.example", "/10.0.1.1"]
