"""What istiod 1.31 adds to a ztunnel's services, from manifests, seen through real proxies.

`ztunnel control-plane --kube DIR` serves the manifests; dedicated `ztunnel proxy` processes play pods
of two namespaces (their DNS proxies answer, their SOCKS5 listeners carry connections). What is
checked is what a client sees: a DNS answer, a connection carried or refused. The rules themselves,
field by field, are checked on the wire (`serve`).

* The mesh config's `serviceEntryVisibility` (the `istio` ConfigMap of `istio-system`): a
  ServiceEntry of a namespace it makes `NAMESPACE` resolves and routes only for clients of that
  namespace; `NONE` is not sent; `exportTo` is not read (istiod's ambient index ignores it).
* Istio's waypoint canary (`istio.io/use-waypoint-canary` and its weight annotation): the share of a
  service's connections its canary waypoint takes (all of them at weight 100).
* `istio.io/ingress-use-waypoint`: for ingress gateways, which an xDS client of the control plane
  receives; ztunnel ignores it (the proxies route as before).
* An AuthorizationPolicy's source `trustDomains`: istiod 1.31 translates none for ztunnel (its
  sidecars and waypoints enforce them); a rule allowing by trust domain alone allows no one, with a
  warning.
* The mesh config's `trustDomain` is the workloads' (their certificates name it): a policy's
  principals match as written, `cluster.local` standing for no other trust domain.
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import dns.message
import dns.rdatatype
import grpc.aio
import pytest

from hbone.identity import Identity
from tests.apps import Echo, socks5_connect, start_echo
from tests.harness import ControlPlane, Fleet, proxy_env
from tests.kube_wire import serve, subset
from tests.relays import Relay, start_waypoint
from xds.gen.envoy.service.discovery.v3 import discovery_pb2, discovery_pb2_grpc
from xds.gen.istio.workload import workload_pb2

pytestmark = pytest.mark.timeout(180)

NET = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"
CLIENT, OUTSIDER, ENDPOINT, CP_HOST = f"{NET}.2", f"{NET}.4", f"{NET}.5", f"{NET}.10"
# The waypoints' pods (test relays that record the CONNECTs they get), and the services' VIPs.
PRIMARY, CANARY = f"{NET}.6", f"{NET}.7"
ECHO_VIP, PRIMARY_VIP, CANARY_VIP = f"{NET}.60", f"{NET}.61", f"{NET}.62"
# The ServiceEntry's address: a loopback address nothing listens on, so that a proxy that does not
# know the service passes the connection through and is refused at once.
PARTNER_VIP, OPEN_VIP = f"{NET}.50", f"{NET}.51"


def mesh_config(body: str) -> str:
    indented = "".join(f"    {line}\n" for line in body.strip("\n").splitlines())
    return f"""
---
apiVersion: v1
kind: ConfigMap
metadata: {{name: istio, namespace: istio-system}}
data:
  mesh: |
{indented}"""


PRIVATE_EGRESS = mesh_config(
    """
serviceEntryVisibility:
  policies:
    - visibility: NAMESPACE
      matchingRules: [{namespaceSelector: {matchLabels: {egress: private}}}]
"""
)

NAMESPACES = """
apiVersion: v1
kind: Namespace
metadata: {name: demo, labels: {istio.io/dataplane-mode: ambient, egress: private}}
---
apiVersion: v1
kind: Namespace
metadata: {name: other, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Namespace
metadata: {name: istio-system}
"""


def pod(name: str, ns: str, ip: str) -> str:
    return f"""
---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}, labels: {{app: {name}, version: v1}}}}
spec: {{serviceAccountName: {name}}}
status:
  podIP: {ip}
  conditions: [{{type: Ready, status: "True"}}]
"""


def service_entry(name: str, ns: str, host: str, vip: str, endpoint: str, port: int, extra: str = "") -> str:
    return f"""
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {{name: {name}, namespace: {ns}}}
spec:
  hosts: [{host}]
  addresses: ["{vip}"]
  ports: [{{number: 80, targetPort: {port}, name: tcp, protocol: TCP}}]
  resolution: STATIC
  endpoints: [{{address: "{endpoint}"}}]{extra}
"""


def waypoint(name: str, ip: str, vip: str, traffic: str = "service") -> str:
    """A waypoint as the manifests of a cluster give it: its Gateway, its Service, its pod."""
    return f"""
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: {name}, namespace: demo, labels: {{istio.io/waypoint-for: {traffic}}}}}
spec: {{gatewayClassName: istio-waypoint, listeners: [{{name: mesh, port: 15008, protocol: HBONE}}]}}
---
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: demo, labels: {{gateway.istio.io/managed: istio.io-mesh-controller}}}}
spec:
  clusterIP: {vip}
  selector: {{gateway.networking.k8s.io/gateway-name: {name}}}
  ports: [{{name: mesh, port: 15008}}]
---
apiVersion: v1
kind: Pod
metadata:
  name: {name}-0
  namespace: demo
  labels: {{gateway.networking.k8s.io/gateway-name: {name}, networking.istio.io/tunnel: http}}
spec: {{serviceAccountName: {name}}}
status:
  podIP: {ip}
  conditions: [{{type: Ready, status: "True"}}]
"""


def echo_service(labels: str, annotations: str = "{}") -> str:
    return f"""
---
apiVersion: v1
kind: Service
metadata: {{name: echo, namespace: demo, labels: {labels}, annotations: {annotations}}}
spec: {{clusterIP: {ECHO_VIP}, selector: {{app: echo}}, ports: [{{name: tcp, port: 80}}]}}
"""


CANARY_100 = echo_service(
    "{istio.io/use-waypoint: primary, istio.io/use-waypoint-canary: canary, istio.io/ingress-use-waypoint: 'true'}",
    "{istio.io/use-waypoint-canary-weight: '100'}",
)
WAYPOINTS = waypoint("primary", PRIMARY, PRIMARY_VIP) + waypoint("canary", CANARY, CANARY_VIP)


def weighted(primary: int, canary: int) -> list[dict[str, object]]:
    def entry(name: str, weight: int) -> dict[str, object]:
        destination = {
            "hostname": {"namespace": "demo", "hostname": f"{name}.demo.svc.cluster.local"},
            "hbone_mtls_port": 15008,
        }
        return {"destination": destination, "weight": weight} if weight else {"destination": destination}

    return [entry("primary", primary), entry("canary", canary)]


# --- on the wire ---------------------------------------------------------------------------------


def test_canary_waypoint_labels_become_weighted_waypoints() -> None:
    served = serve(
        NAMESPACES
        + WAYPOINTS
        + echo_service(
            "{istio.io/use-waypoint: primary, istio.io/use-waypoint-canary: canary}",
            "{istio.io/use-waypoint-canary-weight: '30'}",
        )
    )
    subset(
        {
            "waypoint": weighted(1, 0)[0]["destination"],
            "weighted_waypoints": weighted(70, 30),
        },
        served.services["demo/echo.demo.svc.cluster.local"],
    )
    # No weight: the canary is resolved and takes nothing.
    no_weight = serve(
        NAMESPACES
        + WAYPOINTS
        + echo_service("{istio.io/use-waypoint: primary, istio.io/use-waypoint-canary: canary}")
    )
    assert no_weight.services["demo/echo.demo.svc.cluster.local"]["weighted_waypoints"] == weighted(100, 0)


def test_canary_from_the_namespace_only_with_the_namespaces_primary() -> None:
    namespace = """
apiVersion: v1
kind: Namespace
metadata:
  name: demo
  labels: {istio.io/use-waypoint: primary, istio.io/use-waypoint-canary: canary}
  annotations: {istio.io/use-waypoint-canary-weight: "25"}
"""
    inherited = serve(namespace + WAYPOINTS + echo_service("{}"))
    assert inherited.services["demo/echo.demo.svc.cluster.local"]["weighted_waypoints"] == weighted(75, 25)
    # A primary of its own: the namespace's canary is not the service's.
    own = serve(namespace + WAYPOINTS + echo_service("{istio.io/use-waypoint: primary}"))
    assert "weighted_waypoints" not in own.services["demo/echo.demo.svc.cluster.local"]


@pytest.mark.parametrize(
    ("labels", "annotations", "warning"),
    [
        (
            "istio.io/use-waypoint-canary: primary",
            "{}",
            "canary waypoint demo/primary must differ from the primary",
        ),
        (
            "istio.io/use-waypoint-canary: canary",
            "{istio.io/use-waypoint-canary-weight: '101'}",
            "invalid weight '101'",
        ),
        (
            "istio.io/use-waypoint-canary: canary",
            "{istio.io/use-waypoint-canary-weight: half}",
            "invalid weight 'half'",
        ),
        ("istio.io/use-waypoint-canary: nope", "{}", "waypoint demo/nope is not found"),
        (
            "istio.io/use-waypoint-canary: workloads",
            "{}",
            "canary waypoint demo/workloads is for workload traffic",
        ),
        (
            "istio.io/use-waypoint-canary: canary, istio.io/use-waypoint-canary-namespace: other",
            "{}",
            "waypoint other/canary is not found",
        ),
    ],
)
def test_a_canary_that_cannot_be_honoured_leaves_the_primary_alone(
    labels: str, annotations: str, warning: str
) -> None:
    served = serve(
        NAMESPACES
        + WAYPOINTS
        + waypoint("workloads", f"{NET}.8", f"{NET}.63", "workload")
        + echo_service(f"{{istio.io/use-waypoint: primary, {labels}}}", annotations)
    )
    service = served.services["demo/echo.demo.svc.cluster.local"]
    assert "weighted_waypoints" not in service
    assert service["waypoint"] == weighted(1, 0)[0]["destination"]
    assert served.warned("Service demo/echo", warning, "the primary waypoint takes all its traffic"), (
        served.index.warnings
    )


def test_service_entry_visibility_from_the_mesh_config() -> None:
    entries = (
        service_entry("partner", "demo", "partner.example", "10.9.0.1", "10.9.1.1", 80)
        + service_entry("open", "other", "open.example", "10.9.0.2", "10.9.1.2", 80, "\n  exportTo: ['.']")
        + service_entry("gone", "hidden", "gone.example", "10.9.0.3", "10.9.1.3", 80)
    )
    hidden = """
---
apiVersion: v1
kind: Namespace
metadata: {name: hidden, labels: {egress: none}}
"""
    config = mesh_config(
        """
serviceEntryVisibility:
  defaultVisibility: PUBLIC
  policies:
    - visibility: NONE
      matchingRules:
        - namespaceSelector: {matchExpressions: [{key: egress, operator: In, values: [none]}]}
    - visibility: NAMESPACE
      matchingRules: [{namespaceSelector: {matchLabels: {egress: private}}}]
"""
    )
    served = serve(NAMESPACES + hidden + config + entries)
    assert served.services["demo/partner.example"]["visibility"] == "NAMESPACE"
    # A namespace-only entry is never the canonical one of its hostname.
    assert "canonical" not in served.services["demo/partner.example"]
    # exportTo is not read: only the mesh config scopes a ServiceEntry for ztunnel.
    assert "visibility" not in served.services["other/open.example"]
    assert served.services["other/open.example"]["canonical"] is True
    assert served.warned("ServiceEntry other/open", "spec.exportTo is not read for ztunnel")
    # NONE: neither the services nor the endpoints are sent.
    assert "hidden/gone.example" not in served.services
    assert not [uid for uid in served.workloads if "/hidden/" in uid]
    assert served.warned("ServiceEntry hidden/gone", "serviceEntryVisibility is NONE")
    # Without the mesh config every ServiceEntry is public.
    assert "visibility" not in serve(NAMESPACES + hidden + entries).services["demo/partner.example"]


def test_a_namespace_only_entry_takes_no_waypoint_of_another_namespace() -> None:
    waypoint = """
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: egress, namespace: other}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{name: mesh, port: 15008, protocol: HBONE, allowedRoutes: {namespaces: {from: All}}}]
"""
    entry = service_entry("partner", "demo", "partner.example", "10.9.0.1", "10.9.1.1", 80).replace(
        "namespace: demo}",
        "namespace: demo, labels: {istio.io/use-waypoint: egress, istio.io/use-waypoint-namespace: other}}",
    )
    public = serve(NAMESPACES + waypoint + entry)
    assert public.services["demo/partner.example"]["waypoint"]["hostname"]["namespace"] == "other"
    private = serve(NAMESPACES + PRIVATE_EGRESS + waypoint + entry)
    assert "waypoint" not in private.services["demo/partner.example"]
    assert private.warned("ServiceEntry demo/partner", "waypoint other/egress in another namespace")


def test_a_mesh_config_that_cannot_be_read_is_refused_and_everything_is_public() -> None:
    broken = mesh_config("serviceEntryVisibility: {defaultVisibility: PRIVATE}")
    served = serve(
        NAMESPACES + broken + service_entry("partner", "demo", "partner.example", "10.9.0.1", "10.9.1.1", 80)
    )
    assert any(
        "ConfigMap istio-system/istio refused: data.mesh: serviceEntryVisibility.defaultVisibility: "
        "unknown visibility 'PRIVATE'" in r
        for r in served.refusals
    ), served.refusals
    assert "visibility" not in served.services["demo/partner.example"]


def test_ingress_use_waypoint_from_the_label_of_a_service_with_a_waypoint() -> None:
    def echo(labels: str, namespace_label: str = "") -> dict[str, object]:
        namespaces = NAMESPACES.replace("egress: private}", f"egress: private{namespace_label}}}")
        return serve(namespaces + WAYPOINTS + echo_service(labels)).services[
            "demo/echo.demo.svc.cluster.local"
        ]

    assert (
        echo("{istio.io/use-waypoint: primary, istio.io/ingress-use-waypoint: 'true'}")[
            "ingress_use_waypoint"
        ]
        is True
    )
    assert (
        echo("{istio.io/use-waypoint: primary, istio.io/ingress-use-waypoint: 'T'}")["ingress_use_waypoint"]
        is True
    )
    # The namespace's label, unless the service has its own.
    assert echo("{istio.io/use-waypoint: primary}", ", istio.io/ingress-use-waypoint: '1'")[
        "ingress_use_waypoint"
    ]
    assert "ingress_use_waypoint" not in echo(
        "{istio.io/use-waypoint: primary, istio.io/ingress-use-waypoint: 'false'}",
        ", istio.io/ingress-use-waypoint: 'true'",
    )
    # Without a waypoint it means nothing and is not sent.
    assert "ingress_use_waypoint" not in echo("{istio.io/ingress-use-waypoint: 'true'}")
    entry = service_entry("partner", "demo", "partner.example", "10.9.0.1", "10.9.1.1", 80).replace(
        "namespace: demo}",
        "namespace: demo, labels: {istio.io/use-waypoint: primary, istio.io/ingress-use-waypoint: 'true'}}",
    )
    assert (
        serve(NAMESPACES + WAYPOINTS + entry).services["demo/partner.example"]["ingress_use_waypoint"] is True
    )
    invalid = serve(
        NAMESPACES
        + WAYPOINTS
        + echo_service("{istio.io/use-waypoint: primary, istio.io/ingress-use-waypoint: 'yes'}")
    )
    assert "ingress_use_waypoint" not in invalid.services["demo/echo.demo.svc.cluster.local"]
    assert invalid.warned("Service demo/echo", "invalid value for label istio.io/ingress-use-waypoint: 'yes'")


TRUST_DOMAIN_POLICY = """
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: by-trust-domain, namespace: other}}
spec:
  action: ALLOW
  rules:
    - from: [{{source: {{trustDomains: [cluster.local]}}}}]
      to: [{{operation: {{ports: ["{by_trust_domain}"]}}}}]
    - from: [{{source: {{principals: [cluster.local/ns/demo/sa/partner], notTrustDomains: [other.example]}}}}]
    - to: [{{operation: {{ports: ["{open}"]}}}}]
"""


def test_source_trust_domains_are_not_sent_and_a_warning_says_what_that_does() -> None:
    served = serve(
        NAMESPACES
        + pod("outsider", "other", "10.0.0.4")
        + TRUST_DOMAIN_POLICY.format(by_trust_domain=8080, open=9090)
    )
    groups = served.policies["other/by-trust-domain"]["rules"]
    # As istiod sends it: the trust-domain source is an empty match (which matches nothing), the
    # principal is as written, without its trust-domain condition.
    assert groups[0]["clauses"] == [{"matches": [{"destination_ports": [8080]}]}, {"matches": [{}]}]
    assert groups[1]["clauses"] == [
        {"matches": [{"principals": [{"exact": "cluster.local/ns/demo/sa/partner"}]}]}
    ]
    assert served.warned(
        "AuthorizationPolicy other/by-trust-domain",
        "ztunnel does not enforce notTrustDomains and trustDomains (istiod leaves them out of the policy it sends)",
    ), served.index.warnings


def test_the_mesh_config_trust_domain_is_the_workloads() -> None:
    workload = "Kubernetes//Pod/demo/client"
    corp = serve(NAMESPACES + mesh_config("trustDomain: corp.example") + pod("client", "demo", "10.0.0.2"))
    assert corp.workloads[workload]["trust_domain"] == "corp.example"
    # istiod leaves the default out, as without a mesh config.
    default = serve(
        NAMESPACES + mesh_config("trustDomain: cluster.local") + pod("client", "demo", "10.0.0.2")
    )
    assert "trust_domain" not in default.workloads[workload]


def test_a_services_export_to_annotation_is_not_read_with_a_warning() -> None:
    service = echo_service("{}", "{networking.istio.io/exportTo: '.'}")
    served = serve(NAMESPACES + service)
    assert "visibility" not in served.services["demo/echo.demo.svc.cluster.local"]
    assert served.warned(
        "Service demo/echo", "the networking.istio.io/exportTo annotation is not read for ztunnel"
    )
    assert not serve(NAMESPACES + echo_service("{}", "{networking.istio.io/exportTo: '*'}")).index.warnings


# --- through proxies -----------------------------------------------------------------------------


@dataclass
class Mesh:
    cp: ControlPlane
    echo: Echo
    primary: Relay
    canary: Relay
    outsider_ports: tuple[int, int]  # its app's port allowed by trust domain, and its open one


def env_of(ip: str, workload: str, cp: ControlPlane) -> dict[str, str]:
    """A dedicated proxy of `workload` fed by the control plane; certificates from the fake CA."""
    env = proxy_env(ip, workload, INSTANCE_IP=ip, ZTUNNEL_WORKER_THREADS="1")
    del env["LOCAL_XDS"]
    env["XDS_ADDRESS"] = cp.url
    return env


@pytest.fixture
async def mesh(tmp_path: Path, fleet: Fleet) -> AsyncIterator[Mesh]:
    echo = await start_echo(ENDPOINT, 0)
    port = echo.server.sockets[0].getsockname()[1]
    # The outsider's apps: one port its policy opens by trust domain, one it opens to all.
    apps = [await start_echo(OUTSIDER, 0) for _ in range(2)]
    by_trust_domain, open_port = (app.server.sockets[0].getsockname()[1] for app in apps)
    primary = await start_waypoint(PRIMARY, Identity("cluster.local", "demo", "primary"), {})
    canary = await start_waypoint(CANARY, Identity("cluster.local", "demo", "canary"), {})
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "00-namespaces.yaml").write_text(NAMESPACES + PRIVATE_EGRESS)
    (manifests / "10-pods.yaml").write_text(
        pod("client", "demo", CLIENT)
        + pod("outsider", "other", OUTSIDER)
        + service_entry("partner", "demo", "partner.example", PARTNER_VIP, ENDPOINT, port)
        + service_entry("open", "other", "open.example", OPEN_VIP, ENDPOINT, port, "\n  exportTo: ['.']")
    )
    (manifests / "20-waypoints.yaml").write_text(WAYPOINTS + CANARY_100)
    (manifests / "30-policy.yaml").write_text(
        TRUST_DOMAIN_POLICY.format(by_trust_domain=by_trust_domain, open=open_port)
    )
    try:
        cp = await asyncio.to_thread(fleet.control_plane, tmp_path, CP_HOST, None, "--kube", str(manifests))
        await fleet.start(
            env_of(CLIENT, "demo/client/client", cp), env_of(OUTSIDER, "other/outsider/outsider", cp)
        )
        yield Mesh(cp, echo, primary, canary, (by_trust_domain, open_port))
    finally:
        echo.server.close()
        for app in apps:
            app.server.close()
        await primary.close()
        await canary.close()


async def resolve(proxy_ip: str, name: str) -> list[str]:
    """The A records a proxy's DNS server answers for `name` (none when it only forwards the query)."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        s.connect((proxy_ip, 15053))
        await loop.sock_sendall(s, dns.message.make_query(name, "A").to_wire())
        try:
            async with asyncio.timeout(5):
                reply = dns.message.from_wire(await loop.sock_recv(s, 65535))
        except TimeoutError:
            return []  # forwarded, and the upstream did not answer
    return [r.address for rrset in reply.answer if rrset.rdtype == dns.rdatatype.A for r in rrset]


async def carried(proxy_ip: str, host: str, payload: bytes, port: int = 80) -> bool:
    code, reader, writer = await socks5_connect((proxy_ip, 15080), host, port)
    try:
        if code != 0:
            return False
        writer.write(payload)
        return await asyncio.wait_for(reader.readexactly(len(payload)), 10) == payload
    except (OSError, asyncio.IncompleteReadError):
        return False
    finally:
        writer.close()


async def test_a_namespace_only_service_entry_is_for_its_namespace_alone(mesh: Mesh) -> None:
    # Its namespace's pods resolve it and reach its endpoint through its address.
    assert await resolve(CLIENT, "partner.example") == [PARTNER_VIP]
    assert await carried(CLIENT, PARTNER_VIP, b"to the partner")
    # Another namespace's pods neither resolve it (the query is forwarded) nor route to it: the
    # connection passes through to the bare address, where nothing listens.
    assert PARTNER_VIP not in await resolve(OUTSIDER, "partner.example")
    assert not await carried(OUTSIDER, PARTNER_VIP, b"to the partner")
    # exportTo scopes nothing for ztunnel, as with istiod: another namespace resolves and reaches
    # the entry exported to its own namespace only; the control plane says so.
    assert await resolve(CLIENT, "open.example") == [OPEN_VIP]
    assert await carried(CLIENT, OPEN_VIP, b"exported to other only")
    assert "ServiceEntry other/open: spec.exportTo is not read for ztunnel" in mesh.cp.log()


async def test_the_canary_waypoint_takes_the_share_its_weight_gives(mesh: Mesh) -> None:
    # At weight 100 every connection to the service goes to the canary waypoint, none to the primary.
    for _ in range(3):
        _code, _reader, writer = await socks5_connect((CLIENT, 15080), ECHO_VIP, 80)
        writer.close()  # the relay has no onward route: what counts is which waypoint was asked
    assert [s.authority for s in mesh.canary.seen] == [f"{ECHO_VIP}:80"] * 3
    assert [s.peer_identity for s in mesh.canary.seen] == ["spiffe://cluster.local/ns/demo/sa/client"] * 3
    assert mesh.primary.seen == []


async def test_an_ingress_gateway_is_told_to_use_the_waypoint(mesh: Mesh) -> None:
    """What an xDS client of the control plane (an ingress gateway) receives for the service."""
    async with grpc.aio.insecure_channel(mesh.cp.address) as channel:
        call = discovery_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources()
        request = discovery_pb2.DeltaDiscoveryRequest(type_url="type.googleapis.com/istio.workload.Address")
        request.node.id = "router~10.0.0.9~ingress.istio-system~istio-system.svc.cluster.local"
        await call.write(request)
        async with asyncio.timeout(10):
            response = await call.read()
        call.cancel()
    assert isinstance(response, discovery_pb2.DeltaDiscoveryResponse)
    services = {}
    for resource in response.resources:
        address = workload_pb2.Address.FromString(resource.resource.value)
        if address.HasField("service"):
            services[address.service.hostname] = address.service
    assert services["echo.demo.svc.cluster.local"].ingress_use_waypoint
    assert not services["canary.demo.svc.cluster.local"].ingress_use_waypoint


async def test_a_rule_by_trust_domain_alone_allows_no_one(mesh: Mesh) -> None:
    by_trust_domain, open_port = mesh.outsider_ports
    assert await carried(CLIENT, OUTSIDER, b"to the open port", open_port)
    # The client's trust domain is cluster.local, the one the rule names; ztunnel never sees it.
    code, _reader, writer = await socks5_connect((CLIENT, 15080), OUTSIDER, by_trust_domain)
    writer.close()
    assert code == 2  # connection not allowed by ruleset: the destination's proxy denied it
    assert "ztunnel does not enforce notTrustDomains and trustDomains" in mesh.cp.log()


def principals_policy(as_default: int, as_configured: int) -> str:
    return f"""
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: by-principal, namespace: other}}
spec:
  action: ALLOW
  rules:
    - from: [{{source: {{principals: [cluster.local/ns/demo/sa/client]}}}}]
      to: [{{operation: {{ports: ["{as_default}"]}}}}]
    - from: [{{source: {{principals: [corp.example/ns/demo/sa/client]}}}}]
      to: [{{operation: {{ports: ["{as_configured}"]}}}}]
"""


async def test_principals_name_the_mesh_trust_domain_as_written(tmp_path: Path, fleet: Fleet) -> None:
    apps = [await start_echo(OUTSIDER, 0) for _ in range(2)]
    as_default, as_configured = (app.server.sockets[0].getsockname()[1] for app in apps)
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "mesh.yaml").write_text(
        NAMESPACES
        + mesh_config("trustDomain: corp.example")
        + pod("client", "demo", CLIENT)
        + pod("outsider", "other", OUTSIDER)
        + principals_policy(as_default, as_configured)
    )
    try:
        cp = await asyncio.to_thread(fleet.control_plane, tmp_path, CP_HOST, None, "--kube", str(manifests))
        # Certificates from the control plane's CA, for the identities the workloads say.
        await fleet.start(
            cp.wire(env_of(CLIENT, "demo/client/client", cp)),
            cp.wire(env_of(OUTSIDER, "other/outsider/outsider", cp)),
        )
        assert await carried(CLIENT, OUTSIDER, b"as configured", as_configured)
        assert cp.certificates_issued("spiffe://corp.example/ns/demo/sa/client") >= 1
        code, _reader, writer = await socks5_connect((CLIENT, 15080), OUTSIDER, as_default)
        writer.close()
        assert code == 2  # cluster.local/... is not the client: denied by the outsider's proxy
    finally:
        for app in apps:
            app.server.close()
