"""SPIFFE identities (`spiffe://<trust domain>/ns/<namespace>/sa/<service account>`) and the one
X.509 profile of a workload leaf that carries one (`build_leaf`).

The leaf profile lives here, beside the identity it carries and next to the peer checks that judge
it (`hbone/tls.py`), so that every issuer of the project signs the same certificate: the fake CA
(`ztunnel/identity/certificates.py`), the development control plane's CA (`controlplane/ca.py`) and the tests.
`hbone/` imports nothing else of ours, so both the proxy and the control plane may import it.
"""

from __future__ import annotations

import datetime
import functools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    # Declared aliases: mypyc's build, which has no cryptography to read, takes them as Any.
    LeafPublicKey: TypeAlias = ec.EllipticCurvePublicKey | rsa.RSAPublicKey
    SigningKey: TypeAlias = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
    # What a workload leaf may be used for: both ends of mutual TLS present the same certificate.
    WORKLOAD_EKU: tuple[x509.ObjectIdentifier, ...]

SPIFFE_PREFIX = "spiffe://"


def _workload_eku() -> tuple[x509.ObjectIdentifier, ...]:
    from cryptography.x509.oid import ExtendedKeyUsageOID

    return (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)


def __getattr__(name: str) -> Any:
    # The leaf's side of this module needs cryptography, loaded by its users only: a process that
    # only parses and compares identities (a data-plane worker) never loads it.
    if name == "WORKLOAD_EKU":
        return _workload_eku()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True, slots=True)
class Identity:
    trust_domain: str
    namespace: str
    service_account: str

    @classmethod
    def parse(cls, uri: str) -> Identity:
        """Parse a SPIFFE URI; raise ValueError when it is not of the SPIFFE workload form.

        Only a URI that splits into exactly five `/`-separated parts after the scheme, whose second
        and fourth parts are `ns` and `sa`, is an identity.
        """
        if not uri.startswith(SPIFFE_PREFIX):
            raise ValueError(f"identity must start with {SPIFFE_PREFIX}: {uri!r}")
        parts = uri[len(SPIFFE_PREFIX) :].split("/")
        if len(parts) != 5 or parts[1] != "ns" or parts[3] != "sa":
            raise ValueError(f"not a SPIFFE workload identity: {uri!r}")
        return cls(parts[0], parts[2], parts[4])

    @classmethod
    def try_parse(cls, uri: str) -> Identity | None:
        try:
            return cls.parse(uri)
        except ValueError:
            return None

    def __str__(self) -> str:
        return f"{SPIFFE_PREFIX}{self.trust_domain}/ns/{self.namespace}/sa/{self.service_account}"


# Held connections keep these strings for their lifetime: one shared copy each, not one per connection.
@functools.lru_cache(maxsize=4096)
def uri_of(identity: Identity) -> str:
    """An identity's URI text, one shared copy per identity (admission and the listeners' telemetry)."""
    return str(identity)


def leaf_serial() -> int:
    """A random, positive serial of 159 bits (RFC 5280 allows at most 20 octets, and never 0)."""
    serial = 0
    while serial == 0:
        serial = secrets.randbits(159)
    return serial


def build_leaf(
    uris: Sequence[str],
    public_key: LeafPublicKey,
    issuer: x509.Certificate,
    issuer_key: SigningKey,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
    *,
    subject: x509.Name | None = None,
    dns_names: Sequence[str] = (),
    eku: Sequence[x509.ObjectIdentifier] | None = None,
    serial: int | None = None,
) -> x509.Certificate:
    """Sign a workload leaf: the URI SANs `uris` (the SPIFFE identity first), not a CA,
    KeyUsage digitalSignature + keyEncipherment (critical), EKU serverAuth + clientAuth.

    The subject is empty unless given (as Istio's CA issues); with an empty subject the SAN is the
    whole name and so critical, otherwise not (RFC 5280 §4.2.1.6). Key identifiers are always set:
    a leaf whose subject equals its issuer's (the fake CA's `O=cluster.local`) would otherwise be
    taken for self-signed by OpenSSL. `eku` defaults to `WORKLOAD_EKU`; `eku=()` leaves the EKU out
    (tests of refused chains).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    if eku is None:
        eku = _workload_eku()
    name = subject if subject is not None else x509.Name([])
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    sans += [x509.DNSName(d) for d in dns_names]
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject)
        .public_key(public_key)
        .serial_number(serial if serial is not None else leaf_serial())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectAlternativeName(sans), critical=len(name) == 0)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
    )
    if eku:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(eku)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())
