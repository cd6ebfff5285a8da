"""The development CA: its root on disk, signing workload CSRs, and the CreateCertificate service.

The root is a self-signed ECDSA P-256 certificate created on first start in the CA directory (or loaded
from it). A CSR is signed when its signature verifies and it names exactly one SPIFFE URI SAN; the leaf
carries that SAN only, in the workload leaf profile the proxy's fake CA and the tests also sign
(`hbone.identity.build_leaf`; the control plane shares that one builder, not the proxy's code). The
response chain is `[leaf, root]`: the proxy takes the last element as its trust bundle.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hbone.identity import build_leaf
from xds.gen.istio.v1.auth import ca_pb2, ca_pb2_grpc

log = logging.getLogger(__name__)

ROOT_CERT_FILE = "root-cert.pem"
ROOT_KEY_FILE = "root-key.pem"
ROOT_VALIDITY = datetime.timedelta(days=3650)
SERVING_VALIDITY = datetime.timedelta(days=365)
DEFAULT_MAX_TTL = datetime.timedelta(hours=24)
ROOT_SUBJECT = x509.Name(
    [
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cluster.local"),
        x509.NameAttribute(NameOID.COMMON_NAME, "ztunnel-py development control plane root"),
    ]
)


class CaDirectoryError(Exception):
    """The CA directory cannot be used (unreadable, unwritable, or not a CA we can sign with)."""


class CsrRejected(ValueError):
    """A CSR the CA refuses to sign; the message says why."""


def default_ca_dir() -> Path:
    """Where the CA lives unless `--ca-dir` says otherwise: under the user's state directory (XDG)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "ztunnel-py" / "control-plane-ca"


# How far before its issue a workload leaf's validity starts.
LEAF_BACKDATE = datetime.timedelta(seconds=60)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class SignedCertificate:
    """A leaf and the chain to send with it (`[leaf PEM, root PEM]`)."""

    certificate: x509.Certificate
    chain_pem: tuple[str, ...]

    @property
    def identity(self) -> str:
        return _uri_sans(self.certificate.extensions)[0]


class CertificateAuthority:
    """A root key and certificate, and the leaves signed with them."""

    def __init__(
        self,
        key: ec.EllipticCurvePrivateKey,
        root: x509.Certificate,
        root_path: Path,
        max_ttl: datetime.timedelta = DEFAULT_MAX_TTL,
    ) -> None:
        self.key = key
        self.root = root
        self.root_path = root_path
        self.root_pem = root.public_bytes(serialization.Encoding.PEM).decode()
        self.max_ttl = max_ttl

    @classmethod
    def load_or_create(
        cls, directory: Path, max_ttl: datetime.timedelta = DEFAULT_MAX_TTL
    ) -> CertificateAuthority:
        """Load the root from `directory`, or create one there if it has none yet."""
        cert_path, key_path = directory / ROOT_CERT_FILE, directory / ROOT_KEY_FILE
        try:
            if cert_path.exists() or key_path.exists():
                return cls._load(cert_path, key_path, max_ttl)
            return cls._create(directory, cert_path, key_path, max_ttl)
        except OSError as e:
            raise CaDirectoryError(f"CA directory {directory}: {e.strerror or e}") from None

    @classmethod
    def _load(cls, cert_path: Path, key_path: Path, max_ttl: datetime.timedelta) -> CertificateAuthority:
        try:
            root = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except ValueError as e:
            raise CaDirectoryError(f"CA directory {cert_path.parent}: cannot load the root: {e}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != root.public_key():
            raise CaDirectoryError(f"{key_path}: not the EC private key of {cert_path}")
        return cls(key, root, cert_path, max_ttl)

    @classmethod
    def _create(
        cls, directory: Path, cert_path: Path, key_path: Path, max_ttl: datetime.timedelta
    ) -> CertificateAuthority:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        root = (
            x509.CertificateBuilder()
            .subject_name(ROOT_SUBJECT)
            .issuer_name(ROOT_SUBJECT)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + ROOT_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(_key_usage(cert_sign=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        # The key first and private from birth: a crash between the writes leaves no readable root
        # without its key, and no moment where the key is world-readable.
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem)
        cert_path.write_bytes(root.public_bytes(serialization.Encoding.PEM))
        log.info("created a new CA root in %s", directory)
        return cls(key, root, cert_path, max_ttl)

    def sign_csr(self, csr_pem: str, validity: datetime.timedelta) -> SignedCertificate:
        """Sign a PEM PKCS#10 CSR for its one URI SAN; `validity` is capped at `max_ttl`."""
        try:
            csr = x509.load_pem_x509_csr(csr_pem.encode())
        except ValueError as e:
            raise CsrRejected(f"not a PEM certificate request: {e}") from None
        if not csr.is_signature_valid:
            raise CsrRejected("the request's signature does not verify")
        uris = _uri_sans(csr.extensions)
        if len(uris) != 1 or not uris[0].startswith("spiffe://"):
            raise CsrRejected(f"expected exactly one spiffe:// URI SAN, got {uris or 'none'}")
        if validity <= datetime.timedelta(0) or validity > self.max_ttl:
            validity = self.max_ttl
        public_key = csr.public_key()
        if not isinstance(public_key, ec.EllipticCurvePublicKey | rsa.RSAPublicKey):
            raise CsrRejected("the request's key is neither EC nor RSA")
        # Valid from a little before now, for the same length: a verifier whose clock is a second
        # behind ours (another node's, or this one's stepped back) must not find it not yet valid.
        start = _now() - LEAF_BACKDATE
        # The one workload leaf profile of the project (empty subject, critical SPIFFE SAN).
        leaf = build_leaf([uris[0]], public_key, self.root, self.key, start, start + validity)
        return SignedCertificate(
            leaf, (leaf.public_bytes(serialization.Encoding.PEM).decode(), self.root_pem)
        )

    def serving_certificate(self, host: str) -> tuple[bytes, bytes]:
        """A TLS server certificate and key (PEM) for the control plane itself, valid for `host`.

        Loopback names are always included so `https://localhost:…` and `https://127.0.0.1:…` both verify.
        """
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for name in (host, "localhost", "127.0.0.1", "::1"):
            general = _general_name(name)
            if general is not None and general not in names:
                names.append(general)
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ztunnel-py control plane")]))
            .issuer_name(self.root.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + SERVING_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=not cert_sign,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _uri_sans(extensions: x509.Extensions) -> list[str]:
    try:
        san = extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return san.get_values_for_type(x509.UniformResourceIdentifier)


def _general_name(name: str) -> x509.GeneralName | None:
    if name in ("", "0.0.0.0", "::"):  # a wildcard bind names no host
        return None
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


class CertificateService(ca_pb2_grpc.IstioCertificateServiceServicer):
    """`istio.v1.auth.IstioCertificateService`: signs any identity asked for (no token check: development)."""

    def __init__(self, ca: CertificateAuthority) -> None:
        self.ca = ca

    async def CreateCertificate(
        self, request: ca_pb2.IstioCertificateRequest, context: grpc.aio.ServicerContext
    ) -> ca_pb2.IstioCertificateResponse:
        metadata = dict(context.invocation_metadata() or ())
        impersonated = request.metadata.fields.get("ImpersonatedIdentity")
        try:
            signed = self.ca.sign_csr(request.csr, datetime.timedelta(seconds=request.validity_duration))
        except CsrRejected as e:
            log.warning("refused a certificate request from %s: %s", context.peer(), e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid CSR: {e}")
            raise  # unreachable: abort raises
        log.info(
            "issued a certificate for %s (impersonated %s, valid until %s, token %s, cluster %s, peer %s)",
            signed.identity,
            impersonated.string_value if impersonated is not None else "-",
            signed.certificate.not_valid_after_utc.isoformat(),
            "present" if metadata.get("authorization") else "absent",
            metadata.get("clusterid", "-"),
            context.peer(),
        )
        return ca_pb2.IstioCertificateResponse(cert_chain=list(signed.chain_pem))
