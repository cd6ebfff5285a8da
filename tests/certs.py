"""Throwaway certificate authorities and SPIFFE workload certificates for tests.

`make_ca()` makes a self-signed root (or, with `parent`, an intermediate); `issue()` signs an ECDSA
P-256 leaf with the given URI SANs through the project's one leaf builder (`hbone.identity.build_leaf`)
and returns it as the `WorkloadCertificate` the `hbone` package takes; `make_crl()` writes a CRL of
a CA revoking some of its certificates.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from hbone.identity import WORKLOAD_EKU, Identity, build_leaf
from hbone.tls import WorkloadCertificate


@dataclass(frozen=True)
class CA:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    chain_pem: tuple[bytes, ...]  # this CA's certificate and its intermediates up to (not incl.) the root
    root_pem: bytes

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def make_ca(name: str = "hbone test root", *, parent: CA | None = None) -> CA:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "test"), x509.NameAttribute(NameOID.COMMON_NAME, name)]
    )
    issuer = parent.cert.subject if parent else subject
    signer = parent.key if parent else key
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(signer, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    if parent is None:
        return CA(key, cert, (), pem)
    return CA(key, cert, (pem, *parent.chain_pem), parent.root_pem)


def issue(
    ca: CA,
    identity_uri: str,
    *,
    extra_uris: Sequence[str] = (),
    roots: Sequence[bytes] | None = None,
    eku: Sequence[x509.ObjectIdentifier] = WORKLOAD_EKU,
    valid_for: datetime.timedelta = datetime.timedelta(days=1),
    dns_names: Sequence[str] = (),
) -> WorkloadCertificate:
    """Sign a workload leaf for `identity_uri` (plus `extra_uris`) with `ca`.

    `roots` defaults to the CA's root; `WorkloadCertificate.identity` is the parsed `identity_uri`
    (a non-SPIFFE URI gets a placeholder identity in trust domain "invalid").
    """
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = build_leaf(
        [identity_uri, *extra_uris],
        key.public_key(),
        ca.cert,
        ca.key,
        now - datetime.timedelta(minutes=5),
        now + valid_for,
        subject=x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "test")]),
        dns_names=dns_names,
        eku=eku,
    )
    identity = Identity.try_parse(identity_uri) or Identity("invalid", "invalid", "invalid")
    return WorkloadCertificate(
        identity=identity,
        chain_pem=(cert.public_bytes(serialization.Encoding.PEM), *ca.chain_pem),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        roots_pem=tuple(roots) if roots is not None else (ca.root_pem,),
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
    )


def spiffe(trust_domain: str = "cluster.local", namespace: str = "default", sa: str = "default") -> str:
    return f"spiffe://{trust_domain}/ns/{namespace}/sa/{sa}"


def leaf(cert: WorkloadCertificate) -> x509.Certificate:
    """The parsed leaf of a workload certificate."""
    return x509.load_pem_x509_certificate(cert.chain_pem[0])


def make_crl(
    ca: CA,
    revoked: Sequence[WorkloadCertificate | x509.Certificate] = (),
    *,
    signer: CA | None = None,
) -> bytes:
    """A PEM CRL issued by `ca` revoking `revoked` (workload certificates: their leaf; or any
    certificate `ca` signed); `signer` signs it with another CA's key (a forged CRL)."""
    now = _now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.cert.subject)
        .last_update(now - datetime.timedelta(minutes=1))
        .next_update(now + datetime.timedelta(days=1))
    )
    for item in revoked:
        cert = leaf(item) if isinstance(item, WorkloadCertificate) else item
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder()
            .serial_number(cert.serial_number)
            .revocation_date(now - datetime.timedelta(minutes=1))
            .build()
        )
    crl = builder.sign((signer or ca).key, hashes.SHA256())
    return crl.public_bytes(serialization.Encoding.PEM)
