"""The gRPC CA client against a CA server written here, which records what the proxy sends and signs
with a throwaway CA."""

from __future__ import annotations

import datetime
import re
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from google.protobuf import json_format

from hbone.identity import Identity
from hbone.tls import TlsCredentials
from tests.certs import CA, issue, make_ca
from xds.channel import AuthToken
from xds.gen.istio.v1.auth import ca_pb2, ca_pb2_grpc
from ztunnel.identity.caclient import GrpcCaClient
from ztunnel.identity.certhelper import CertHelper
from ztunnel.identity.certificates import CaError, CertificateUnavailable, SecretManager

IDENTITY = Identity("cluster.local", "demo", "client")

Reply = Callable[["RecordingCa", ca_pb2.IstioCertificateRequest], list[str]]


def sign(ca: CA, csr: x509.CertificateSigningRequest, uri: str, ttl: int) -> str:
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(ca.cert.subject)
        .public_key(csr.public_key())  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(seconds=ttl))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=True)
        .sign(ca.key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode()


@dataclass
class RecordingCa(ca_pb2_grpc.IstioCertificateServiceServicer):
    """Signs with an intermediate under `root`, and sends a bundle of two roots as the last element."""

    root: CA = field(default_factory=make_ca)
    other_root: CA = field(default_factory=lambda: make_ca("second root"))
    requests: list[ca_pb2.IstioCertificateRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    reply: Reply | None = None
    status: tuple[grpc.StatusCode, str] | None = None

    def __post_init__(self) -> None:
        self.intermediate = make_ca("intermediate", parent=self.root)

    def chain_for(self, request: ca_pb2.IstioCertificateRequest, uri: str | None = None) -> list[str]:
        csr = x509.load_pem_x509_csr(request.csr.encode())
        sans = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        leaf = sign(
            self.intermediate,
            csr,
            uri or sans.get_values_for_type(x509.UniformResourceIdentifier)[0],
            request.validity_duration,
        )
        bundle = (self.root.root_pem + self.other_root.root_pem).decode()
        return [leaf, self.intermediate.pem.decode(), bundle]

    async def CreateCertificate(
        self, request: ca_pb2.IstioCertificateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ca_pb2.IstioCertificateResponse:
        self.requests.append(request)
        self.metadata.append({m.key: m.value for m in context.invocation_metadata() or ()})
        if self.status is not None:
            await context.abort(*self.status)
        chain = self.reply(self, request) if self.reply else self.chain_for(request)
        return ca_pb2.IstioCertificateResponse(cert_chain=chain)


@dataclass
class CaServer:
    ca: RecordingCa
    port: int
    server: grpc.aio.Server

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def start_ca(credentials: grpc.ServerCredentials | None = None) -> CaServer:
    ca = RecordingCa()
    server = grpc.aio.server()
    ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(ca, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return CaServer(ca, port, server)


@pytest.fixture
async def ca_server() -> AsyncIterator[CaServer]:
    server = await start_ca()
    try:
        yield server
    finally:
        await server.server.stop(None)


@pytest.fixture
async def closing() -> AsyncIterator[list[GrpcCaClient]]:
    made: list[GrpcCaClient] = []
    yield made
    for client in made:
        await client.close()


def client_for(server: CaServer, closing: list[GrpcCaClient], **kwargs: Any) -> GrpcCaClient:
    client = GrpcCaClient(server.address, **kwargs)
    closing.append(client)
    return client


async def test_the_request_is_istios_csr_with_the_ttl_and_headers(
    ca_server: CaServer, closing: list[GrpcCaClient]
) -> None:
    client = client_for(
        ca_server,
        closing,
        token=AuthToken(value="sa-token"),
        cluster_id="cluster-2",
        headers=[("x-tenant", "blue")],
        secret_ttl=3600,
    )
    await client.fetch(IDENTITY)

    (request,) = ca_server.ca.requests
    csr = x509.load_pem_x509_csr(request.csr.encode())
    assert request.csr.startswith("-----BEGIN CERTIFICATE REQUEST-----")
    assert csr.is_signature_valid
    assert len(csr.subject) == 0
    (extension,) = csr.extensions
    assert extension.critical and isinstance(extension.value, x509.SubjectAlternativeName)
    assert list(extension.value) == [
        x509.UniformResourceIdentifier("spiffe://cluster.local/ns/demo/sa/client")
    ]
    public_key = csr.public_key()
    assert isinstance(public_key, ec.EllipticCurvePublicKey) and public_key.curve.name == "secp256r1"
    assert isinstance(csr.signature_hash_algorithm, hashes.SHA256)
    assert request.validity_duration == 3600
    assert not request.HasField("metadata")  # dedicated mode: no impersonation
    headers = ca_server.ca.metadata[0]
    assert headers["authorization"] == "Bearer sa-token"
    assert headers["clusterid"] == "cluster-2"
    assert headers["x-tenant"] == "blue"


async def test_shared_mode_asks_to_impersonate(ca_server: CaServer, closing: list[GrpcCaClient]) -> None:
    await client_for(ca_server, closing, impersonate=True).fetch(IDENTITY)
    metadata = json_format.MessageToDict(ca_server.ca.requests[0].metadata)
    assert metadata == {"ImpersonatedIdentity": "spiffe://cluster.local/ns/demo/sa/client"}


async def test_the_chain_is_leaf_intermediates_then_a_bundle_of_roots(
    ca_server: CaServer, closing: list[GrpcCaClient]
) -> None:
    cert = await client_for(ca_server, closing, secret_ttl=7200).fetch(IDENTITY)

    assert cert.identity == IDENTITY
    leaf_pem, intermediate_pem = cert.chain_pem
    leaf = x509.load_pem_x509_certificate(leaf_pem)
    assert intermediate_pem.strip() == ca_server.ca.intermediate.pem.strip()
    (bundle,) = cert.roots_pem
    roots = x509.load_pem_x509_certificates(bundle)
    assert [r.subject for r in roots] == [
        ca_server.ca.root.cert.subject,
        ca_server.ca.other_root.cert.subject,
    ]
    assert (cert.not_before, cert.not_after) == (leaf.not_valid_before_utc, leaf.not_valid_after_utc)
    assert cert.not_after - cert.not_before == datetime.timedelta(seconds=7200)
    key = serialization.load_pem_private_key(cert.key_pem, password=None)
    assert cert.key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8
    assert key.public_key() == leaf.public_key()
    # The material makes TLS contexts: the key matches, the roots load.
    TlsCredentials.build(cert)  # both contexts load the key pair and the roots


async def test_shared_mode_refuses_a_leaf_for_another_identity(
    ca_server: CaServer, closing: list[GrpcCaClient]
) -> None:
    ca_server.ca.reply = lambda ca, request: ca.chain_for(
        request, uri="spiffe://cluster.local/ns/demo/sa/other"
    )
    with pytest.raises(
        CaError, match=re.escape("did not find expected SAN spiffe://cluster.local/ns/demo/sa/client")
    ):
        await client_for(ca_server, closing, impersonate=True).fetch(IDENTITY)
    # A dedicated proxy asks for itself and takes what its CA signs.
    cert = await client_for(ca_server, closing).fetch(IDENTITY)
    assert cert.identity == IDENTITY


async def test_an_empty_chain_is_an_error(ca_server: CaServer, closing: list[GrpcCaClient]) -> None:
    ca_server.ca.reply = lambda ca, request: []
    with pytest.raises(CaError, match="empty certificate chain"):
        await client_for(ca_server, closing).fetch(IDENTITY)


async def test_a_grpc_status_is_an_error_naming_it(ca_server: CaServer, closing: list[GrpcCaClient]) -> None:
    ca_server.ca.status = (grpc.StatusCode.PERMISSION_DENIED, "not allowed to impersonate")
    with pytest.raises(CaError, match="PERMISSION_DENIED: not allowed to impersonate"):
        await client_for(ca_server, closing).fetch(IDENTITY)


async def test_an_unreachable_ca_is_an_error_naming_it(closing: list[GrpcCaClient]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = GrpcCaClient(f"http://127.0.0.1:{port}")
    closing.append(client)
    with pytest.raises(CaError, match=f"CA 127.0.0.1:{port} unreachable: UNAVAILABLE"):
        await client.fetch(IDENTITY)


async def test_an_unreadable_token_is_an_error(
    ca_server: CaServer, closing: list[GrpcCaClient], tmp_path: Path
) -> None:
    empty = tmp_path / "token"
    empty.write_text("")
    with pytest.raises(CaError, match="is empty"):
        await client_for(ca_server, closing, token=AuthToken(path=str(empty))).fetch(IDENTITY)
    assert ca_server.ca.requests == []


async def test_the_secret_manager_gets_certificates_through_it(
    ca_server: CaServer, closing: list[GrpcCaClient]
) -> None:
    manager = SecretManager(client_for(ca_server, closing))
    try:
        cert = await manager.get(IDENTITY)
        assert cert.identity == IDENTITY
        (entry,) = manager.dump()
        assert entry["state"] == "Available" and len(entry["rootCerts"]) == 2
        ca_server.ca.status = (grpc.StatusCode.INTERNAL, "boom")
        with pytest.raises(CertificateUnavailable, match="INTERNAL: boom"):
            await manager.get(Identity("cluster.local", "demo", "other"))
    finally:
        await manager.close()


async def test_https_verifies_the_ca_with_its_root_and_follows_a_changed_root(
    tmp_path: Path, closing: list[GrpcCaClient]
) -> None:
    tls_root = make_ca("control plane root")
    leaf = issue(tls_root, "spiffe://cluster.local/ns/istio-system/sa/istiod", dns_names=["istiod.test"])
    server = await start_ca(grpc.ssl_server_credentials([(leaf.key_pem, b"".join(leaf.chain_pem))]))
    try:
        root_file = tmp_path / "root-cert.pem"
        root_file.write_bytes(make_ca("not the one").root_pem)
        client = GrpcCaClient(
            f"https://127.0.0.1:{server.port}", root_ca=str(root_file), alt_hostname="istiod.test"
        )
        closing.append(client)
        with pytest.raises(CaError, match="unreachable"):
            await client.fetch(IDENTITY)
        # The root file is replaced (as a ConfigMap update does): the next request uses it.
        root_file.write_bytes(tls_root.root_pem)
        cert = await client.fetch(IDENTITY)
        assert cert.identity == IDENTITY
    finally:
        await server.server.stop(None)


async def test_through_the_helper_process_as_in_this_process(
    ca_server: CaServer, closing: list[GrpcCaClient]
) -> None:
    """The proxy's parent has its helper process make the key and check the answer: the same
    certificate material, and the same refusal."""
    helper = CertHelper()
    try:
        cert = await client_for(ca_server, closing, work=helper).fetch(IDENTITY)
        leaf = x509.load_pem_x509_certificate(cert.chain_pem[0])
        key = serialization.load_pem_private_key(cert.key_pem, password=None)
        assert key.public_key() == leaf.public_key() and cert.not_before == leaf.not_valid_before_utc
        local = await client_for(ca_server, closing).fetch(IDENTITY)
        assert (len(cert.chain_pem), cert.roots_pem) == (len(local.chain_pem), local.roots_pem)
        assert cert.root_info == local.root_info and len(cert.chain_info) == 2
        ca_server.ca.reply = lambda ca, request: ca.chain_for(
            request, uri="spiffe://cluster.local/ns/demo/sa/x"
        )
        errors = []
        for work in (helper, None):
            with pytest.raises(CaError) as caught:
                await client_for(ca_server, closing, impersonate=True, work=work).fetch(IDENTITY)
            errors.append(str(caught.value))
        assert errors[0] == errors[1] and "did not find expected SAN" in errors[0]
        assert helper.started == 1
    finally:
        await helper.close()


@pytest.mark.parametrize(
    "bundle",
    [
        "",
        " \n",
        "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIJ+DYvh6SEqVTm50DFtMDoQikTmiCqirVv9mWG9qfSnF\n-----END PRIVATE KEY-----\n",
        "not a certificate",
    ],
    ids=["empty", "blank", "a key alone", "text"],
)
async def test_a_root_bundle_without_a_certificate_is_refused_in_one_line(
    ca_server: CaServer, closing: list[GrpcCaClient], bundle: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The chain's last element, the trust bundle, holds no certificate: the fetch fails with one line
    naming the CA and why, never a certificate that trusts nothing (or anything)."""
    ca_server.ca.reply = lambda ca, request: [*ca.chain_for(request)[:2], bundle]
    with pytest.raises(CaError) as info:
        await client_for(ca_server, closing).fetch(IDENTITY)
    assert str(info.value) == (
        f"CA 127.0.0.1:{ca_server.port} returned a root bundle without a certificate for {IDENTITY}"
    )
