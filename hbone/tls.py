"""TLS for HBONE: contexts built from a workload certificate, and SPIFFE peer checks (SPEC §2.2, §2.3).

Both sides: TLS 1.3 only, ALPN exactly `h2`, mutual authentication against the roots delivered with
our own certificate, no session tickets or resumption. The client sends no SNI and does not check a
host name; instead, after the handshake, the server leaf must carry one of the expected SPIFFE
identities (`check_server_identity`). The server requires a client certificate and, after the
handshake, a SPIFFE identity in its own trust domain (`check_client_trust_domain`).

Limitation: Python's `ssl` (3.11) cannot restrict the TLS 1.3 cipher suites (`set_ciphers` only
governs TLS 1.2 and below), so OpenSSL's default TLS 1.3 list applies, which also contains
TLS_CHACHA20_POLY1305_SHA256. The server prefers its own order, whose first suite is
TLS_AES_256_GCM_SHA384, so ChaCha20 is only used with a peer that offers no AES-GCM suite.
"""

from __future__ import annotations

import os
import shutil
import ssl
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from cryptography import x509

from hbone.errors import IdentityMismatch, TlsHandshakeError
from hbone.identity import Identity

ALPN_H2 = "h2"


@dataclass(frozen=True)
class WorkloadCertificate:
    """A workload's certificate material, as issued by a CA (or the fake CA)."""

    identity: Identity
    chain_pem: tuple[bytes, ...]  # leaf first, then intermediates (PEM)
    key_pem: bytes  # PKCS#8 private key (PEM)
    roots_pem: tuple[bytes, ...]  # trust anchors (PEM); several may be concatenated in one element
    not_before: datetime
    not_after: datetime


def _base_context(protocol: int, cert: WorkloadCertificate) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols([ALPN_H2])
    ctx.options |= ssl.OP_NO_TICKET | ssl.OP_NO_COMPRESSION
    ctx.verify_mode = ssl.CERT_REQUIRED
    roots = b"".join(r if r.endswith(b"\n") else r + b"\n" for r in cert.roots_pem)
    if not roots.strip():
        raise ValueError(f"certificate for {cert.identity} has no trust roots")
    ctx.load_verify_locations(cadata=roots.decode("ascii"))
    _load_key_pair(ctx, cert)
    return ctx


def _load_key_pair(ctx: ssl.SSLContext, cert: WorkloadCertificate) -> None:
    # The ssl module only loads a key pair from a file: write it to a private file (0600 in a
    # 0700 directory, in memory when /dev/shm exists) and delete it right after loading.
    parent = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    directory = tempfile.mkdtemp(prefix="hbone-", dir=parent)
    try:
        path = os.path.join(directory, "pair.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(cert.key_pem if cert.key_pem.endswith(b"\n") else cert.key_pem + b"\n")
            for pem in cert.chain_pem:
                f.write(pem if pem.endswith(b"\n") else pem + b"\n")
        ctx.load_cert_chain(path)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def server_context(cert: WorkloadCertificate) -> ssl.SSLContext:
    """Context for the inbound side (:15008): presents `cert`, requires a client certificate."""
    ctx = _base_context(ssl.PROTOCOL_TLS_SERVER, cert)
    ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    ctx.num_tickets = 0  # TLS 1.3: no tickets at all, so no resumption
    return ctx


def client_context(cert: WorkloadCertificate) -> ssl.SSLContext:
    """Context for the outbound side. Use with no server name: no SNI, no host name check."""
    ctx = _base_context(ssl.PROTOCOL_TLS_CLIENT, cert)
    ctx.check_hostname = False
    return ctx


class ContextCache:
    """Reuses contexts across connections: building one costs a file round trip and key parsing.

    Keyed by the certificate material itself (identity, chain, roots), so a rotated certificate or
    trust bundle gets a new context. Bounded; least recently used entries go first.
    """

    def __init__(self, max_entries: int = 256) -> None:
        self._max = max_entries
        self._client: OrderedDict[tuple[object, ...], ssl.SSLContext] = OrderedDict()
        self._server: OrderedDict[tuple[object, ...], ssl.SSLContext] = OrderedDict()

    @staticmethod
    def _key(cert: WorkloadCertificate) -> tuple[object, ...]:
        return (cert.identity, cert.chain_pem, cert.roots_pem)

    def _get(
        self, table: OrderedDict[tuple[object, ...], ssl.SSLContext], cert: WorkloadCertificate, server: bool
    ) -> ssl.SSLContext:
        key = self._key(cert)
        ctx = table.get(key)
        if ctx is None:
            ctx = server_context(cert) if server else client_context(cert)
            table[key] = ctx
            while len(table) > self._max:
                table.popitem(last=False)
        else:
            table.move_to_end(key)
        return ctx

    def client(self, cert: WorkloadCertificate) -> ssl.SSLContext:
        return self._get(self._client, cert, server=False)

    def server(self, cert: WorkloadCertificate) -> ssl.SSLContext:
        return self._get(self._server, cert, server=True)


def uri_sans(leaf: x509.Certificate) -> list[str]:
    """URI SANs of a certificate, in certificate order (empty without a SubjectAltName)."""
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(san.get_values_for_type(x509.UniformResourceIdentifier))


def peer_uri_sans(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> list[str]:
    """URI SANs of the peer's leaf certificate (empty without a peer certificate)."""
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return []
    return uri_sans(x509.load_der_x509_certificate(der))


def peer_identities(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> list[Identity]:
    """The peer leaf's URI SANs that parse as SPIFFE identities, in certificate order."""
    out = []
    for uri in peer_uri_sans(ssl_object):
        ident = Identity.try_parse(uri)
        if ident is not None:
            out.append(ident)
    return out


def check_alpn(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> None:
    proto = ssl_object.selected_alpn_protocol()
    if proto != ALPN_H2:
        raise TlsHandshakeError(f"tls handshake error: ALPN negotiated {proto!r}, expected 'h2'")


def check_server_identity(
    ssl_object: ssl.SSLObject | ssl.SSLSocket, expected: Sequence[Identity]
) -> Identity:
    """Client side: any URI SAN of the server leaf must equal any expected identity.

    Returns the server's identity (its first SPIFFE SAN); raises `IdentityMismatch`.
    """
    got = peer_identities(ssl_object)
    wanted = set(expected)
    if not any(i in wanted for i in got):
        raise IdentityMismatch(expected, got)
    return got[0]


def check_client_trust_domain(ssl_object: ssl.SSLObject | ssl.SSLSocket, trust_domain: str) -> Identity:
    """Server side: the client leaf must have a SPIFFE SAN in our trust domain.

    Returns the client's identity (its first SPIFFE SAN); raises `TlsHandshakeError`.
    """
    got = peer_identities(ssl_object)
    if not any(i.trust_domain == trust_domain for i in got):
        raise TlsHandshakeError(
            f"tls handshake error: client identity {[str(i) for i in got]} is not in trust domain {trust_domain!r}"
        )
    return got[0]
