"""The development control plane as a proxy (or a person) meets it: over real gRPC, with a raw client.

The client here is written against the generated stubs only, not the proxy's xDS client, so these
tests check the wire, not agreement between two halves of our own code.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from OpenSSL import crypto

from controlplane.ca import CertificateAuthority
from controlplane.server import ControlPlane
from controlplane.snapshot import snapshot_from_config
from mesh.localconfig import LocalConfigError, parse_local_config
from xds.gen.envoy.service.discovery.v3 import discovery_pb2, discovery_pb2_grpc
from xds.gen.istio.security import authorization_pb2
from xds.gen.istio.v1.auth import ca_pb2, ca_pb2_grpc
from xds.gen.istio.workload import workload_pb2

# The wire names, spelled out: the test checks them rather than trusting our constants.
ADDRESS_TYPE = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION_TYPE = "type.googleapis.com/istio.security.Authorization"
CLIENT_UID = "lab//v1/Pod/demo/client"
SERVER_UID = "lab//v1/Pod/demo/server"
SERVICE = "demo/server.demo.svc.cluster.local"

CONFIG = """
workloads:
  - uid: lab//v1/Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client-sa
    trustDomain: cluster.local
    workloadIps: ["127.0.0.2"]
    protocol: HBONE
  - uid: lab//v1/Pod/demo/server
    name: server
    namespace: demo
    serviceAccount: server-sa
    trustDomain: cluster.local
    workloadIps: ["127.0.0.3"]
    protocol: HBONE
    services:
      "demo/server.demo.svc.cluster.local":
        80: 8080
services:
  - name: server
    namespace: demo
    hostname: server.demo.svc.cluster.local
    vips: ["/10.96.1.1"]
    ports:
      80: 8080
policies:
  - name: only-client
    namespace: demo
    scope: Namespace
    action: Allow
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/client-sa"]
  - name: block-9999
    namespace: demo
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - destinationPorts: [9999]
"""

# The server workload moves to another service account, a third workload appears, and the deny
# policy goes away: two Address updates and one Authorization removal.
EDITED = (
    CONFIG.replace("serviceAccount: server-sa", "serviceAccount: server-v2")
    .replace(
        "services:\n  - name: server",
        """  - uid: lab//v1/Pod/demo/other
    namespace: demo
    workloadIps: ["127.0.0.4"]
services:
  - name: server""",
    )
    .split("  - name: block-9999")[0]
)

BROKEN = CONFIG.replace('workloadIps: ["127.0.0.3"]', 'workloadIps: ["127.0.0.999"]')

WAIT = 10.0  # generous bound for something that must happen; never a measured duration


def write_config(path: Path, text: str) -> None:
    """Replace the file in one step, as editors that save by rename do."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def eventually(condition: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(WAIT):
        while not condition():
            await asyncio.sleep(0.02)
    assert condition(), what


class AdsClient:
    """A raw Delta ADS stream: what a proxy sends and receives, nothing more."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = discovery_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources()

    async def subscribe(self, type_url: str, initial: dict[str, str] | None = None) -> None:
        request = discovery_pb2.DeltaDiscoveryRequest(
            type_url=type_url, initial_resource_versions=initial or {}
        )
        request.node.id = "ztunnel~127.0.0.2~client.demo~demo.svc.cluster.local"
        await self.call.write(request)

    async def receive(self) -> discovery_pb2.DeltaDiscoveryResponse:
        async with asyncio.timeout(WAIT):
            response = await self.call.read()
        assert isinstance(response, discovery_pb2.DeltaDiscoveryResponse), response
        return response

    async def ack(self, response: discovery_pb2.DeltaDiscoveryResponse, error: str | None = None) -> None:
        request = discovery_pb2.DeltaDiscoveryRequest(
            type_url=response.type_url, response_nonce=response.nonce
        )
        if error is not None:
            request.error_detail.message = error
        await self.call.write(request)

    async def receive_and_ack(self) -> discovery_pb2.DeltaDiscoveryResponse:
        response = await self.receive()
        await self.ack(response)
        return response

    async def open_both(self, initial: dict[str, dict[str, str]] | None = None) -> dict[str, Pushed]:
        await self.subscribe(ADDRESS_TYPE, (initial or {}).get(ADDRESS_TYPE))
        await self.subscribe(AUTHORIZATION_TYPE, (initial or {}).get(AUTHORIZATION_TYPE))
        first, second = Pushed(await self.receive_and_ack()), Pushed(await self.receive_and_ack())
        return {first.type_url: first, second.type_url: second}


class Pushed:
    """One response, decoded as the client decodes it: by the response's type URL."""

    def __init__(self, response: discovery_pb2.DeltaDiscoveryResponse) -> None:
        self.type_url = response.type_url
        self.nonce = response.nonce
        self.versions = {r.name: r.version for r in response.resources}
        self.removed = sorted(response.removed_resources)
        self.messages: dict[str, workload_pb2.Address | authorization_pb2.Authorization] = {}
        for r in response.resources:
            if self.type_url == ADDRESS_TYPE:
                self.messages[r.name] = workload_pb2.Address.FromString(r.resource.value)
            else:
                self.messages[r.name] = authorization_pb2.Authorization.FromString(r.resource.value)

    @property
    def names(self) -> list[str]:
        return sorted(self.versions)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "mesh.yaml"
    write_config(path, CONFIG)
    return path


@pytest.fixture
async def control_plane(
    config_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[ControlPlane]:
    caplog.set_level(logging.DEBUG, logger="controlplane")
    cp = ControlPlane(config_file, listen="127.0.0.1:0", ca_dir=tmp_path / "ca", poll_interval=0.05)
    await cp.start()
    try:
        yield cp
    finally:
        await cp.stop(grace=0)


@pytest.fixture
async def channel(control_plane: ControlPlane) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(control_plane.address.removeprefix("http://")) as ch:
        yield ch


# --- Delta ADS ----------------------------------------------------------------------------------


async def test_a_new_stream_gets_the_files_resources_decoded(channel: grpc.aio.Channel) -> None:
    client = AdsClient(channel)
    state = await client.open_both()

    addresses = state[ADDRESS_TYPE]
    assert addresses.names == sorted([CLIENT_UID, SERVER_UID, SERVICE])
    assert addresses.removed == []
    server = addresses.messages[SERVER_UID]
    assert isinstance(server, workload_pb2.Address)
    assert server.WhichOneof("type") == "workload"
    w = server.workload
    assert (w.uid, w.name, w.namespace, w.service_account, w.trust_domain) == (
        SERVER_UID,
        "server",
        "demo",
        "server-sa",
        "cluster.local",
    )
    assert list(w.addresses) == [bytes([127, 0, 0, 3])]
    assert w.tunnel_protocol == workload_pb2.HBONE
    assert [(p.service_port, p.target_port) for p in w.services[SERVICE].ports] == [(80, 8080)]
    service = addresses.messages[SERVICE]
    assert isinstance(service, workload_pb2.Address)
    assert service.WhichOneof("type") == "service"
    assert service.service.hostname == "server.demo.svc.cluster.local"
    assert [(a.network, a.address) for a in service.service.addresses] == [("", bytes([10, 96, 1, 1]))]

    policies = state[AUTHORIZATION_TYPE]
    assert policies.names == ["demo/block-9999", "demo/only-client"]
    allow = policies.messages["demo/only-client"]
    assert isinstance(allow, authorization_pb2.Authorization)
    assert allow.action == authorization_pb2.ALLOW
    assert allow.scope == authorization_pb2.NAMESPACE
    (match,) = allow.rules[0].clauses[0].matches
    assert match.principals[0].exact == "cluster.local/ns/demo/sa/client-sa"
    deny = policies.messages["demo/block-9999"]
    assert isinstance(deny, authorization_pb2.Authorization)
    assert deny.action == authorization_pb2.DENY
    assert list(deny.rules[0].clauses[0].matches[0].destination_ports) == [9999]

    assert state[ADDRESS_TYPE].nonce != state[AUTHORIZATION_TYPE].nonce
    await client.call.done_writing()


async def test_a_nack_is_logged_with_its_reason(
    control_plane: ControlPlane,
    config_file: Path,
    channel: grpc.aio.Channel,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = AdsClient(channel)
    await client.subscribe(ADDRESS_TYPE)
    await client.receive_and_ack()
    write_config(config_file, EDITED)
    pushed = await client.receive()
    await client.ack(pushed, error="lab//v1/Pod/demo/other: unsupported thing")
    await eventually(
        lambda: any(
            "NACKed" in r.getMessage() and "unsupported thing" in r.getMessage() for r in caplog.records
        ),
        "the NACK reason in the log",
    )


async def test_an_edit_pushes_exactly_what_changed(config_file: Path, channel: grpc.aio.Channel) -> None:
    client = AdsClient(channel)
    before = await client.open_both()

    write_config(config_file, EDITED)
    addresses = Pushed(await client.receive_and_ack())
    policies = Pushed(await client.receive_and_ack())

    assert addresses.type_url == ADDRESS_TYPE
    assert addresses.names == sorted([SERVER_UID, "lab//v1/Pod/demo/other"])
    assert addresses.removed == []
    moved = addresses.messages[SERVER_UID]
    assert isinstance(moved, workload_pb2.Address)
    assert moved.workload.service_account == "server-v2"
    assert addresses.versions[SERVER_UID] != before[ADDRESS_TYPE].versions[SERVER_UID]
    assert policies.type_url == AUTHORIZATION_TYPE
    assert policies.names == []
    assert policies.removed == ["demo/block-9999"]


async def test_a_broken_edit_is_refused_and_a_later_good_edit_applies(
    config_file: Path, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    client = AdsClient(channel)
    await client.open_both()

    write_config(config_file, BROKEN)
    await eventually(
        lambda: any(
            r.levelno == logging.ERROR and "workloads[1].workloadIps" in r.getMessage()
            for r in caplog.records
        ),
        "an error naming the key path",
    )
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert str(config_file) in error
    assert "\n" not in error

    # Several polls (every 50 ms) see the broken file unchanged before the good edit replaces it: how
    # long it stays is the stimulus (what follows holds however many polls there were), not a wait.
    await asyncio.sleep(0.3)
    # The stream is ordered: if the broken file had been pushed, it would come before this.
    write_config(config_file, EDITED)
    addresses = Pushed(await client.receive_and_ack())
    policies = Pushed(await client.receive_and_ack())
    assert addresses.names == sorted([SERVER_UID, "lab//v1/Pod/demo/other"])
    server = addresses.messages[SERVER_UID]
    assert isinstance(server, workload_pb2.Address)
    assert list(server.workload.addresses) == [bytes([127, 0, 0, 3])]
    assert policies.removed == ["demo/block-9999"]
    # Reported once, not at every poll while the file stayed broken.
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1


async def test_a_reconnect_with_versions_gets_only_what_changed(
    config_file: Path, channel: grpc.aio.Channel
) -> None:
    first = AdsClient(channel)
    known = await first.open_both()
    write_config(config_file, EDITED)
    await first.receive_and_ack()  # the server has the edit once it pushes it
    await first.call.done_writing()

    again = AdsClient(channel)
    held = {type_url: dict(pushed.versions) for type_url, pushed in known.items()}
    held[AUTHORIZATION_TYPE]["demo/never-existed"] = "0"
    state = await again.open_both(initial=held)

    assert state[ADDRESS_TYPE].names == sorted([SERVER_UID, "lab//v1/Pod/demo/other"])
    assert state[ADDRESS_TYPE].removed == []
    assert state[AUTHORIZATION_TYPE].names == []
    assert state[AUTHORIZATION_TYPE].removed == ["demo/block-9999", "demo/never-existed"]


async def test_an_empty_type_is_still_answered(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    write_config(path, "workloads: []\n")
    cp = ControlPlane(path, listen="127.0.0.1:0", ca_dir=tmp_path / "ca")
    await cp.start()
    try:
        async with grpc.aio.insecure_channel(cp.address.removeprefix("http://")) as ch:
            state = await AdsClient(ch).open_both()
        assert state[ADDRESS_TYPE].names == []
        assert state[AUTHORIZATION_TYPE].names == []
    finally:
        await cp.stop(grace=0)


# --- the snapshot's own rules -------------------------------------------------------------------


def test_a_workload_without_uid_cannot_be_served() -> None:
    config = parse_local_config("workloads:\n  - namespace: demo\n    workloadIps: []\n")
    with pytest.raises(LocalConfigError, match=r"f\.yaml: workloads\[0\]\.uid: required"):
        snapshot_from_config(config, "f.yaml")


def test_service_endpoints_are_sent_as_workload_memberships() -> None:
    text = """
workloads:
  - {uid: w1, namespace: demo, workloadIps: ["10.0.0.1"]}
services:
  - name: s
    namespace: demo
    hostname: s.demo
    vips: []
    ports: {80: 0}
    endpoints:
      w1: {workloadUid: w1, port: {80: 9090}}
"""
    snapshot = snapshot_from_config(parse_local_config(text))
    address = workload_pb2.Address.FromString(snapshot.resources[ADDRESS_TYPE]["w1"].resource.value)
    assert [(p.service_port, p.target_port) for p in address.workload.services["demo/s.demo"].ports] == [
        (80, 9090)
    ]


def test_versions_depend_on_content_only() -> None:
    a = snapshot_from_config(parse_local_config(CONFIG))
    b = snapshot_from_config(parse_local_config(CONFIG))
    c = snapshot_from_config(parse_local_config(EDITED))
    assert a.versions(ADDRESS_TYPE) == b.versions(ADDRESS_TYPE)
    assert a.versions(ADDRESS_TYPE)[CLIENT_UID] == c.versions(ADDRESS_TYPE)[CLIENT_UID]
    assert a.versions(ADDRESS_TYPE)[SERVER_UID] != c.versions(ADDRESS_TYPE)[SERVER_UID]


# --- the CA -------------------------------------------------------------------------------------

IDENTITY = "spiffe://cluster.local/ns/demo/sa/server-sa"


def make_csr(identity: str | None = IDENTITY) -> str:
    """A CSR as the proxy makes it: new P-256 key, empty subject, one critical URI SAN."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    if identity is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity)]), critical=True
        )
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()


def verified_leaf(chain: list[str], root_pem: bytes) -> x509.Certificate:
    """The leaf of `chain`, after checking it against `root_pem` both directly and as OpenSSL would."""
    leaf = x509.load_pem_x509_certificate(chain[0].encode())
    root = x509.load_pem_x509_certificate(root_pem)
    leaf.verify_directly_issued_by(root)
    store = crypto.X509Store()
    store.add_cert(crypto.X509.from_cryptography(root))
    crypto.X509StoreContext(store, crypto.X509.from_cryptography(leaf)).verify_certificate()
    return leaf


def uri_sans(cert: x509.Certificate) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.UniformResourceIdentifier)


async def test_create_certificate_issues_the_requested_identity(
    control_plane: ControlPlane, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
    response = await stub.CreateCertificate(
        ca_pb2.IstioCertificateRequest(csr=make_csr(), validity_duration=3600), timeout=WAIT
    )
    chain = list(response.cert_chain)
    root_pem = control_plane.root_cert_path.read_bytes()
    assert len(chain) == 2
    assert chain[-1].encode() == root_pem
    leaf = verified_leaf(chain, root_pem)
    assert uri_sans(leaf) == [IDENTITY]
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc == datetime.timedelta(hours=1)
    assert any(IDENTITY in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("csr", "reason"),
    [
        (make_csr(None), "exactly one spiffe:// URI SAN"),
        ("-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n", "PEM"),
    ],
)
async def test_create_certificate_refuses_a_bad_csr(channel: grpc.aio.Channel, csr: str, reason: str) -> None:
    stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.CreateCertificate(ca_pb2.IstioCertificateRequest(csr=csr), timeout=WAIT)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in (failure.value.details() or "")


def test_the_ca_keeps_its_root_and_caps_validity(tmp_path: Path) -> None:
    first = CertificateAuthority.load_or_create(tmp_path / "ca")
    again = CertificateAuthority.load_or_create(tmp_path / "ca")
    assert again.root_pem == first.root_pem
    assert (tmp_path / "ca" / "root-key.pem").stat().st_mode & 0o077 == 0
    asked = datetime.datetime.now(datetime.UTC)
    signed = again.sign_csr(make_csr(), datetime.timedelta(days=10))
    leaf = verified_leaf(list(signed.chain_pem), first.root_pem.encode())
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc == datetime.timedelta(hours=24)
    # Valid from before it was asked for: a clock a little behind the CA's still accepts it.
    assert leaf.not_valid_before_utc <= asked - datetime.timedelta(seconds=59)


async def test_tls_is_verified_with_the_root(config_file: Path, tmp_path: Path) -> None:
    from tests.certs import make_ca

    cp = ControlPlane(config_file, listen="127.0.0.1:0", tls=True, ca_dir=tmp_path / "ca")
    await cp.start()
    try:
        assert cp.address.startswith("https://127.0.0.1:")
        target = cp.address.removeprefix("https://")
        trusted = grpc.ssl_channel_credentials(root_certificates=cp.root_cert_path.read_bytes())
        async with grpc.aio.secure_channel(target, trusted) as ch:
            state = await AdsClient(ch).open_both()
            assert state[ADDRESS_TYPE].names == sorted([CLIENT_UID, SERVER_UID, SERVICE])
            response = await ca_pb2_grpc.IstioCertificateServiceStub(ch).CreateCertificate(
                ca_pb2.IstioCertificateRequest(csr=make_csr()), timeout=WAIT
            )
            assert uri_sans(verified_leaf(list(response.cert_chain), cp.root_cert_path.read_bytes())) == [
                IDENTITY
            ]

        stranger = grpc.ssl_channel_credentials(root_certificates=make_ca("someone else").pem)
        async with grpc.aio.secure_channel(target, stranger) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await ca_pb2_grpc.IstioCertificateServiceStub(ch).CreateCertificate(
                    ca_pb2.IstioCertificateRequest(csr=make_csr()), timeout=WAIT
                )
            assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await cp.stop(grace=0)


# --- the command --------------------------------------------------------------------------------

CONTROL_PLANE = [sys.executable, "-m", "ztunnel", "control-plane"]


def test_the_command_prints_where_it_listens_and_its_root_and_stops_on_sigterm(
    config_file: Path, tmp_path: Path
) -> None:
    proc = subprocess.Popen(
        [
            *CONTROL_PLANE,
            "--config",
            str(config_file),
            "--listen",
            "127.0.0.1:0",
            "--ca-dir",
            str(tmp_path / "ca"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        listening = proc.stdout.readline()
        root_line = proc.stdout.readline()
        assert listening.startswith("control plane listening on http://127.0.0.1:"), listening
        assert root_line.startswith("root certificate: "), root_line
        root_path = Path(root_line.removeprefix("root certificate: ").strip())
        assert root_path == tmp_path / "ca" / "root-cert.pem"
        with grpc.insecure_channel(listening.strip().rsplit("http://", 1)[1]) as ch:
            response = ca_pb2_grpc.IstioCertificateServiceStub(ch).CreateCertificate(
                ca_pb2.IstioCertificateRequest(csr=make_csr(), validity_duration=600),
                metadata=(("authorization", "Bearer not-checked"),),
                timeout=WAIT,
            )
        leaf = verified_leaf(list(response.cert_chain), root_path.read_bytes())
        assert uri_sans(leaf) == [IDENTITY]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=WAIT)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == 0, stderr
    assert IDENTITY in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--config", "missing.yaml"], "missing.yaml: cannot read"),
        (["--config", "{broken}"], "workloads[1].workloadIps"),
        (["--config", "{good}", "--listen", "nowhere"], "invalid --listen 'nowhere'"),
        (["--config", "{good}", "--listen", "{busy}"], "Address already in use"),
        (["--config", "{good}", "--ca-dir", "{good}/ca"], "good.yaml/ca: Not a directory"),
    ],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(tmp_path: Path, args: list[str], expected: str) -> None:
    broken = tmp_path / "broken.yaml"
    write_config(broken, BROKEN)
    good = tmp_path / "good.yaml"
    write_config(good, CONFIG)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        args = [a.format(broken=broken, good=good, busy=busy) for a in args]
        r = subprocess.run(
            [*CONTROL_PLANE, "--ca-dir", str(tmp_path / "ca"), *args],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
        )
    assert r.returncode != 0
    assert r.stderr.count("\n") == 1, r.stderr
    assert expected in r.stderr
    assert r.stdout == ""
