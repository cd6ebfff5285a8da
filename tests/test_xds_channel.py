"""What the xDS client presents to the control plane: its node, credentials, TLS roots and the
checked host name."""

from __future__ import annotations

from pathlib import Path

import grpc
import grpc.aio
import pytest

from tests.ads import (
    AdsServer,
    Running,
    Sleeps,
    ads_fixture,  # noqa: F401 (a fixture)
    clients_fixture,  # noqa: F401 (a fixture)
    initial_pair,
    run_client,
    start_ads,
)
from tests.certs import issue, make_ca
from xds.channel import node_from
from xds.client import (
    AuthToken,
)
from xds.convert import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL
from ztunnel.metrics.families import Metrics


async def test_initial_requests_name_the_node_and_carry_credentials(
    ads: AdsServer, clients: list[Running], tmp_path: Path
) -> None:
    token_file = tmp_path / "istio-token"
    token_file.write_text("first-token\n")
    node = node_from(
        instance_ip="10.1.2.3",
        pod_name="pod",
        pod_namespace="ns",
        node_name="node-7",
        istio_meta={"ISTIO_VERSION": "1.24.0", "DNS_CAPTURE": "true"},
        istio_meta_json={"LABELS": {"app": "ztunnel"}},
        cluster_id="cluster-9",
    )
    clients.append(
        await run_client(
            ads.address,
            node=node,
            token=AuthToken.from_setting(str(token_file)),
            cluster_id="cluster-9",
            headers=[("x_tenant", "a")],
        )
    )
    stream = await ads.ads.next_stream()
    first, second = await initial_pair(stream)

    assert [first.type_url, second.type_url] == [ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL]
    for request in (first, second):
        assert request.node.id == "ztunnel~10.1.2.3~pod.ns~ns.svc.cluster.local"
        meta = dict(request.node.metadata)
        assert meta["NAME"] == "pod" and meta["NAMESPACE"] == "ns"
        assert meta["INSTANCE_IPS"] == "10.1.2.3" and meta["NODE_NAME"] == "node-7"
        assert meta["ISTIO_VERSION"] == "1.24.0" and meta["CLUSTER_ID"] == "cluster-9"
        assert meta["LABELS"]["app"] == "ztunnel"
        # Wildcard: no names, nothing held yet.
        assert list(request.resource_names_subscribe) == [] == list(request.resource_names_unsubscribe)
        assert dict(request.initial_resource_versions) == {}
        assert request.response_nonce == ""
    assert stream.metadata["authorization"] == "Bearer first-token"
    assert stream.metadata["clusterid"] == "cluster-9"
    assert stream.metadata["x_tenant"] == "a"

    # The token file is read again for the next stream.
    token_file.write_text("second-token")
    stream.end()
    again = await ads.ads.next_stream()
    assert again.metadata["authorization"] == "Bearer second-token"


async def test_https_with_a_root_ca_and_an_alternative_host_name(
    tmp_path: Path, clients: list[Running]
) -> None:
    ca = make_ca("xds test root")
    leaf = issue(ca, "spiffe://cluster.local/ns/istio-system/sa/istiod", dns_names=["istiod.test"])
    creds = grpc.ssl_server_credentials([(leaf.key_pem, b"".join(leaf.chain_pem))])
    server = await start_ads(creds)
    try:
        root = tmp_path / "root-cert.pem"
        root.write_bytes(ca.root_pem)
        running = await run_client(
            f"https://127.0.0.1:{server.port}", root_ca=str(root), alt_hostname="istiod.test"
        )
        clients.append(running)
        stream = await server.ads.next_stream()
        first, _ = await initial_pair(stream)
        assert first.type_url == ADDRESS_TYPE_URL

        # Another root: the handshake fails and counts as a connection error.
        other = tmp_path / "other-root.pem"
        other.write_bytes(make_ca("someone else").root_pem)
        sleeps = Sleeps()
        metrics = Metrics(process_metrics=False)
        refused = await run_client(
            f"https://127.0.0.1:{server.port}",
            root_ca=str(other),
            alt_hostname="istiod.test",
            sleep=sleeps,
            metrics=metrics.xds,
        )
        clients.append(refused)
        assert await sleeps.wait_for(2) == pytest.approx([0.02, 0.04])
        assert (
            'istio_xds_connection_terminations_total{reason="ConnectionError"} '
            in metrics.render(None)[0].decode()
        )
        assert server.ads.streams.empty()  # no stream ever reached the server
    finally:
        await server.server.stop(None)


def test_node_defaults() -> None:
    node = node_from()
    assert node.id == "ztunnel~1.1.1.1~.~.svc.cluster.local"
    assert dict(node.metadata)["INSTANCE_IPS"] == "1.1.1.1"
