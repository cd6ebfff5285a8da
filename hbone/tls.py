"""TLS for HBONE: the credentials of one workload (its certificate and the TLS contexts built from
it, once), SPIFFE peer checks, and certificate revocation.

Both sides: TLS 1.3 only (also TLS 1.2 with `TlsPolicy.tls12`, restricted to ECDHE + AES-GCM
suites), ALPN exactly `h2`, mutual authentication against the roots delivered with our own
certificate, no session tickets or resumption. The client sends no SNI and does not check a host
name; instead, after the handshake, the server leaf must carry one of the expected SPIFFE identities
(`TlsCredentials.verify_server`). The server requires a client certificate and, after the handshake,
a SPIFFE identity in its own trust domain (`TlsCredentials.verify_client`).

`TlsCredentials` is what the listeners take: built when a certificate is issued or rotated (the
secret manager does it), or in a worker process from the PEM bytes its parent shipped
(`TlsCredentials.from_pem`). Nothing here is module-global: whoever holds the credentials holds
their contexts.

The peer checks read a `TlsPeer` (the ALPN chosen, the verified leaf's URI SANs, and with CRLs its
verified chain), whichever engine ran the handshake; cryptography's X.509 parser is loaded only for
what needs certificate objects (PEM credentials, CRLs and the chains they are checked against), so a
process without CRLs never loads it for its connections.

Revocation (`Revocation`): the CRLs in force, checked against the peer's verified chain after each
handshake (a chain no CRL speaks about is accepted: unknown status fails open), and a registry of
the live sessions with their peer chains, re-checked and torn down when new CRLs are installed.
Python's `ssl` gives the verified chain publicly only from 3.13; before, with CRLs in force, HBONE's
TLS runs on pyOpenSSL contexts built beside the `ssl` ones (`OpenSslContexts`, driven by
`hbone.tlsio`), whose verified chain is public API.

Limitation: Python's `ssl` (3.11) cannot restrict the TLS 1.3 cipher suites (`set_ciphers` only
governs TLS 1.2 and below), so OpenSSL's default TLS 1.3 list applies, which also contains
TLS_CHACHA20_POLY1305_SHA256. The server prefers its own order, whose first suite is
TLS_AES_256_GCM_SHA384, so ChaCha20 is only used with a peer that offers no AES-GCM suite.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import ssl
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from hbone.errors import CertificateRevoked, IdentityMismatch, TlsHandshakeError
from hbone.identity import Identity
from hbone.keyfile import load_pem_pair

if TYPE_CHECKING:
    from cryptography import x509
    from OpenSSL import SSL

log = logging.getLogger("hbone")

ALPN_H2 = "h2"
# TLS 1.2 (only with TlsPolicy.tls12): forward-secret ECDHE with AES-GCM, AES-256 first; no ChaCha20.
TLS12_CIPHERS = ":".join(
    (
        "ECDHE-ECDSA-AES256-GCM-SHA384",
        "ECDHE-ECDSA-AES128-GCM-SHA256",
        "ECDHE-RSA-AES256-GCM-SHA384",
        "ECDHE-RSA-AES128-GCM-SHA256",
    )
)
# TLS 1.3 suites of the pyOpenSSL contexts (the `ssl` module cannot restrict them): AES-GCM only.
TLS13_SUITES = "TLS_AES_256_GCM_SHA384:TLS_AES_128_GCM_SHA256"
# Python's `ssl` gives the peer's verified chain publicly from 3.13 on. Before, with CRLs in force
# (whose checks need the chain), HBONE's TLS runs on pyOpenSSL, where it is public too.
STDLIB_VERIFIED_CHAIN = sys.version_info >= (3, 13)
# `get_extra_info` key of a TLS transport of `hbone.tlsio`: its peer (`TlsPeer`).
TLS_PEER = "tls_peer"
# `get_extra_info` key of a session's streams once a new CRL tore the session down: the
# `CertificateRevoked` saying why (what the proxy reports as response flag CERT_REVOKED).
REVOKED = "revoked_by_crl"
# Sessions kept for re-checks on a CRL change; past this, new ones are counted as untracked.
MAX_TRACKED_SESSIONS = 1 << 20


@dataclass(frozen=True)
class WorkloadCertificate:
    """A workload's certificate material, as issued by a CA (or the fake CA)."""

    identity: Identity
    chain_pem: tuple[bytes, ...]  # leaf first, then intermediates (PEM)
    key_pem: bytes  # PKCS#8 private key (PEM)
    roots_pem: tuple[bytes, ...]  # trust anchors (PEM); several may be concatenated in one element
    not_before: datetime
    not_after: datetime


@dataclass(frozen=True)
class TlsPolicy:
    """What every context of a process shares: the versions allowed and the CRLs in force."""

    tls12: bool = False
    revocation: Revocation | None = None


# A PEM block of a certificate (`CERTIFICATE`, `TRUSTED CERTIFICATE`, `X509 CERTIFICATE`).
_PEM_CERTIFICATE = re.compile(rb"-----BEGIN (?:[A-Z0-9]+ )?CERTIFICATE-----")


def holds_certificate(pem: bytes) -> bool:
    """Whether PEM text holds a certificate: trust roots without one are refused, never read as
    "trust nothing" or as the system's roots."""
    return _PEM_CERTIFICATE.search(pem) is not None


def _base_context(protocol: int, cert: WorkloadCertificate, policy: TlsPolicy) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    if policy.tls12:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_ciphers(TLS12_CIPHERS)
    else:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols([ALPN_H2])
    ctx.options |= ssl.OP_NO_TICKET | ssl.OP_NO_COMPRESSION
    ctx.verify_mode = ssl.CERT_REQUIRED
    roots = _joined(cert.roots_pem)
    if not holds_certificate(roots):
        raise ValueError(f"certificate for {cert.identity} has no trust roots (no certificate among them)")
    ctx.load_verify_locations(cadata=roots.decode("ascii"))
    _load_key_pair(ctx, cert)
    return ctx


def _joined(pems: Sequence[bytes]) -> bytes:
    return b"".join(p if p.endswith(b"\n") else p + b"\n" for p in pems)


def _load_key_pair(ctx: ssl.SSLContext, cert: WorkloadCertificate) -> None:
    load_pem_pair(ctx, cert.key_pem, _joined(cert.chain_pem))


def _server_context(cert: WorkloadCertificate, policy: TlsPolicy) -> ssl.SSLContext:
    ctx = _base_context(ssl.PROTOCOL_TLS_SERVER, cert, policy)
    ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    ctx.num_tickets = 0  # TLS 1.3: no tickets at all, so no resumption
    return ctx


def _client_context(cert: WorkloadCertificate, policy: TlsPolicy) -> ssl.SSLContext:
    ctx = _base_context(ssl.PROTOCOL_TLS_CLIENT, cert, policy)
    ctx.check_hostname = False  # used with no server name: no SNI, no host name check
    return ctx


@dataclass(frozen=True, eq=False)
class OpenSslContexts:
    """pyOpenSSL contexts presenting one certificate, for `hbone.tlsio.OpenSslTls`: built with the
    `ssl` ones when CRLs are in force on a Python before 3.13 (see `STDLIB_VERIFIED_CHAIN`)."""

    server: SSL.Context
    client: SSL.Context


def _openssl_context(cert: WorkloadCertificate, policy: TlsPolicy, *, server_side: bool) -> SSL.Context:
    """The pyOpenSSL twin of `_server_context` / `_client_context`: the same versions, ALPN, mutual
    authentication against the same roots, no compression or renegotiation; TLS 1.3 restricted to
    AES-GCM (`TLS13_SUITES`). No session is cached, so none resumes; OpenSSL's TLS 1.3 server
    still sends its (then unusable) tickets, since pyOpenSSL cannot set their count to zero."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
    from OpenSSL import SSL, crypto

    ctx = SSL.Context(SSL.TLS_SERVER_METHOD if server_side else SSL.TLS_CLIENT_METHOD)
    ctx.set_min_proto_version(SSL.TLS1_2_VERSION if policy.tls12 else SSL.TLS1_3_VERSION)
    ctx.set_max_proto_version(SSL.TLS1_3_VERSION)
    if policy.tls12:
        ctx.set_cipher_list(TLS12_CIPHERS.encode("ascii"))
    ctx.set_tls13_ciphersuites(TLS13_SUITES.encode("ascii"))
    ctx.set_options(SSL.OP_NO_TICKET | SSL.OP_NO_COMPRESSION | SSL.OP_NO_RENEGOTIATION)
    ctx.set_session_cache_mode(SSL.SESS_CACHE_OFF)
    ctx.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT)
    roots = [c for pem in cert.roots_pem for c in x509.load_pem_x509_certificates(pem)]
    if not roots:
        raise ValueError(f"certificate for {cert.identity} has no trust roots")
    store = ctx.get_cert_store()
    assert store is not None  # a new context always has its store
    for root in roots:
        store.add_cert(crypto.X509.from_cryptography(root))
    chain = [c for pem in cert.chain_pem for c in x509.load_pem_x509_certificates(pem)]
    key = serialization.load_pem_private_key(cert.key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey):
        raise ValueError(f"a {type(key).__name__} cannot sign a TLS handshake here")
    ctx.use_certificate(chain[0])
    for intermediate in chain[1:]:
        ctx.add_extra_chain_cert(intermediate)
    ctx.use_privatekey(key)
    ctx.check_privatekey()
    if server_side:
        ctx.set_options(SSL.OP_CIPHER_SERVER_PREFERENCE)
        ctx.set_alpn_select_callback(_select_h2)
    else:
        ctx.set_alpn_protos([ALPN_H2.encode("ascii")])
    return ctx


def _select_h2(conn: SSL.Connection, offered: list[bytes]) -> Any:
    # A client not offering h2 gets no ALPN (as from `ssl`), which the peer checks then refuse.
    from OpenSSL import SSL

    return ALPN_H2.encode("ascii") if ALPN_H2.encode("ascii") in offered else SSL.NO_OVERLAPPING_PROTOCOLS


@dataclass(frozen=True, eq=False)
class TlsCredentials:
    """One workload certificate and the two contexts that present it, built together, once.

    `server` is for the inbound side (:15008: presents the certificate, requires a client
    certificate); `client` for dialling (use with no server name). Immutable: a rotated
    certificate is a new `TlsCredentials`.
    """

    cert: WorkloadCertificate
    server: ssl.SSLContext = field(repr=False)
    client: ssl.SSLContext = field(repr=False)
    policy: TlsPolicy
    _roots: tuple[x509.Certificate, ...] = field(repr=False)
    # pyOpenSSL contexts, when the TLS of HBONE runs on it (CRLs before Python 3.13); else None
    openssl: OpenSslContexts | None = field(default=None, repr=False)

    @classmethod
    def build(cls, cert: WorkloadCertificate, policy: TlsPolicy | None = None) -> TlsCredentials:
        """Build both contexts for `cert`; raise ValueError or ssl.SSLError on unusable material."""
        policy = policy or TlsPolicy()
        server, client = _server_context(cert, policy), _client_context(cert, policy)
        roots: tuple[x509.Certificate, ...] = ()
        if policy.revocation is not None:  # the issuers a CRL may be signed by, for its checks
            from cryptography import x509

            roots = tuple(c for pem in cert.roots_pem for c in x509.load_pem_x509_certificates(pem))
        openssl = None
        if policy.revocation is not None and not STDLIB_VERIFIED_CHAIN:
            try:
                openssl = OpenSslContexts(
                    _openssl_context(cert, policy, server_side=True),
                    _openssl_context(cert, policy, server_side=False),
                )
            except Exception as e:  # pyOpenSSL's errors name OpenSSL's reason
                raise ValueError(f"certificate for {cert.identity} does not load: {e}") from e
        return cls(cert, server, client, policy, roots, openssl)

    @classmethod
    def from_pem(
        cls, chain_pem: bytes, key_pem: bytes, roots_pem: bytes, policy: TlsPolicy | None = None
    ) -> TlsCredentials:
        """Credentials from PEM bytes (the chain leaf first, a PKCS#8 key, the concatenated roots),
        as `pem()` gives them: what a parent process ships to its workers.

        The identity is the leaf's first SPIFFE URI SAN and the validity its own; raise ValueError
        when the leaf has no SPIFFE identity or the material does not load.
        """
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        chain = x509.load_pem_x509_certificates(chain_pem)
        leaf = chain[0]
        identity = next((i for u in uri_sans(leaf) if (i := Identity.try_parse(u)) is not None), None)
        if identity is None:
            raise ValueError(f"certificate {leaf.subject.rfc4514_string()!r} has no SPIFFE identity")
        cert = WorkloadCertificate(
            identity=identity,
            chain_pem=tuple(c.public_bytes(serialization.Encoding.PEM) for c in chain),
            key_pem=key_pem,
            roots_pem=(roots_pem,),
            not_before=leaf.not_valid_before_utc,
            not_after=leaf.not_valid_after_utc,
        )
        return cls.build(cert, policy)

    def pem(self) -> tuple[bytes, bytes, bytes]:
        """(chain PEM, key PEM, roots PEM): the arguments of `from_pem`."""
        return _joined(self.cert.chain_pem), self.cert.key_pem, _joined(self.cert.roots_pem)

    @property
    def identity(self) -> Identity:
        return self.cert.identity

    def verify_server(self, peer: TlsPeer, expected: Sequence[Identity]) -> Identity:
        """Client side, after the handshake: ALPN, the server's identity (`check_server_identity`)
        and its chain's revocation status. Returns the server's identity; raises TlsHandshakeError."""
        check_alpn(peer)
        identity = check_server_identity(peer, expected)
        self._check_revocation(peer)
        return identity

    def verify_client(self, peer: TlsPeer, trust_domain: str | None = None) -> Identity:
        """Server side, after the handshake: ALPN, a client identity in `trust_domain` (default: our
        own certificate's) and the client chain's revocation status. Returns the client's identity."""
        check_alpn(peer)
        identity = check_client_trust_domain(peer, trust_domain or self.identity.trust_domain)
        self._check_revocation(peer)
        return identity

    def watch(self, peer: TlsPeer, teardown: Callable[[CertificateRevoked], None]) -> Callable[[], None]:
        """Keep a live session's peer chain for re-checks: `teardown` is called if a later CRL revokes
        it. Returns the function to call when the session ends (does nothing without CRLs)."""
        revocation = self.policy.revocation
        if revocation is None:
            return _nothing
        return revocation.track(peer_chain(peer), teardown, self._roots)

    def peer(self, transport: asyncio.BaseTransport) -> TlsPeer:
        """What the checks read of a TLS transport's peer: our own TLS transport (`hbone.tlsio`)
        says it (`TLS_PEER`); one of the event loop's is read through its `ssl_object`."""
        peer = transport.get_extra_info(TLS_PEER)
        if peer is None:
            peer = TlsPeer.of_ssl(
                transport.get_extra_info("ssl_object"), chain=self.policy.revocation is not None
            )
        return cast(TlsPeer, peer)

    def _check_revocation(self, peer: TlsPeer) -> None:
        if self.policy.revocation is not None:
            self.policy.revocation.check(peer_chain(peer), self._roots)


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class TlsPeer:
    """What a finished handshake says of the peer, whichever TLS engine ran it: the protocol ALPN
    chose, the verified leaf's URI SANs (in certificate order) and, when revocation is checked, its
    verified chain (DER, leaf first, up to the trust anchor; the leaf alone when the engine cannot
    give more)."""

    alpn: str | None
    uri_sans: tuple[str, ...]
    chain: tuple[bytes, ...] = ()

    @classmethod
    def of_ssl(cls, ssl_object: ssl.SSLObject | ssl.SSLSocket, *, chain: bool = False) -> TlsPeer:
        """From the `ssl` module's TLS object. Every context here requires and verifies the peer's
        certificate, so `getpeercert` has the leaf as OpenSSL decoded it. The verified chain is
        public from Python 3.13 (`get_verified_chain`); before, the leaf alone (its issuer is then
        looked up in our roots), which is why CRLs on an older Python run TLS on pyOpenSSL."""
        cert = ssl_object.getpeercert() or {}
        sans = tuple(
            str(entry[1])
            for entry in cert.get("subjectAltName", ())
            if isinstance(entry, tuple) and entry[0] == "URI"
        )
        der: tuple[bytes, ...] = ()
        if chain:
            if STDLIB_VERIFIED_CHAIN:
                der = tuple(ssl_object.get_verified_chain())  # type: ignore[union-attr]
            else:
                leaf = ssl_object.getpeercert(binary_form=True)
                der = (leaf,) if leaf else ()
        return cls(ssl_object.selected_alpn_protocol(), sans, der)

    @property
    def identities(self) -> list[Identity]:
        """The URI SANs that parse as SPIFFE identities, in certificate order."""
        return [i for uri in self.uri_sans if (i := Identity.try_parse(uri)) is not None]


def peer_chain(peer: TlsPeer) -> list[x509.Certificate]:
    """The peer's chain as certificate objects, leaf first."""
    from cryptography import x509

    return [x509.load_der_x509_certificate(der) for der in peer.chain]


# --- revocation ----------------------------------------------------------------------------------


def parse_crls(data: bytes) -> tuple[x509.CertificateRevocationList, ...]:
    """Every CRL of a PEM file (`-----BEGIN X509 CRL-----` blocks); raise ValueError naming the
    problem when there is none or one does not parse."""
    from cryptography import x509

    marker = b"-----BEGIN X509 CRL-----"
    end = b"-----END X509 CRL-----"
    crls: list[x509.CertificateRevocationList] = []
    rest = data
    while (start := rest.find(marker)) >= 0:
        stop = rest.find(end, start)
        if stop < 0:
            raise ValueError(f"CRL {len(crls) + 1} has no END line")
        block = rest[start : stop + len(end)]
        try:
            crls.append(x509.load_pem_x509_crl(block))
        except ValueError as e:
            raise ValueError(f"CRL {len(crls) + 1} does not parse: {e}") from None
        rest = rest[stop + len(end) :]
    if not crls:
        raise ValueError("no PEM CRL (-----BEGIN X509 CRL-----) in the file")
    return tuple(crls)


@dataclass(eq=False)
class _Tracked:
    chain: list[x509.Certificate]
    roots: tuple[x509.Certificate, ...]
    teardown: Callable[[CertificateRevoked], None]


class Revocation:
    """The CRLs in force, and the live TLS sessions whose peer chains are re-checked when they change.

    A certificate is revoked when a CRL issued by its issuer, whose signature verifies with the
    issuer's key (found in the chain, else in our roots), lists its serial number. A certificate no
    valid CRL speaks about is accepted. `on_rejection` is called once per refused handshake or torn
    down session, `on_untracked` once per session admitted but not kept for re-checks.
    """

    def __init__(
        self,
        crls: Sequence[x509.CertificateRevocationList] = (),
        *,
        on_rejection: Callable[[], None] | None = None,
        on_untracked: Callable[[], None] | None = None,
        max_tracked: int = MAX_TRACKED_SESSIONS,
    ) -> None:
        self._on_rejection = on_rejection
        self._on_untracked = on_untracked
        self._max_tracked = max_tracked
        self._tracked: dict[int, _Tracked] = {}
        self._ids = itertools.count()
        self._by_issuer: dict[x509.Name, list[x509.CertificateRevocationList]] = {}
        self._signature_ok: dict[tuple[int, bytes], bool] = {}
        self._crls: tuple[x509.CertificateRevocationList, ...] = ()
        self._install(crls)

    @property
    def crls(self) -> tuple[x509.CertificateRevocationList, ...]:
        return self._crls

    @property
    def tracked(self) -> int:
        """How many live sessions are kept for re-checks."""
        return len(self._tracked)

    def _install(self, crls: Sequence[x509.CertificateRevocationList]) -> None:
        by_issuer: dict[x509.Name, list[x509.CertificateRevocationList]] = {}
        for crl in crls:
            by_issuer.setdefault(crl.issuer, []).append(crl)
        self._crls = tuple(crls)
        self._by_issuer = by_issuer
        self._signature_ok = {}

    def revoked(
        self, chain: Sequence[x509.Certificate], roots: Sequence[x509.Certificate] = ()
    ) -> CertificateRevoked | None:
        """Why `chain` (leaf first) is revoked, or None when no valid CRL lists one of its certificates."""
        for i, cert in enumerate(chain):
            crls = self._by_issuer.get(cert.issuer)
            # No CRL for this issuer, or a trust anchor (which no CRL revokes). Not "issuer ==
            # subject": the fake CA's leaves carry their root's subject.
            if not crls or cert in roots:
                continue
            issuer = _find_issuer(cert, chain[i + 1 :], roots)
            if issuer is None:
                continue  # a CRL we cannot authenticate does not decide anything
            for crl in crls:
                if crl.get_revoked_certificate_by_serial_number(cert.serial_number) is None:
                    continue
                if self._valid_signature(crl, issuer):
                    return CertificateRevoked(cert, position=i)
        return None

    def check(self, chain: Sequence[x509.Certificate], roots: Sequence[x509.Certificate] = ()) -> None:
        """Raise `CertificateRevoked` (counted as a rejection) when `chain` is revoked."""
        err = self.revoked(chain, roots)
        if err is not None:
            self._rejected()
            raise err

    def track(
        self,
        chain: Sequence[x509.Certificate],
        teardown: Callable[[CertificateRevoked], None],
        roots: Sequence[x509.Certificate] = (),
    ) -> Callable[[], None]:
        """Keep a live session for re-checks; returns its release function."""
        if len(self._tracked) >= self._max_tracked or not chain:
            if self._on_untracked is not None:
                self._on_untracked()
            return _nothing
        key = next(self._ids)
        self._tracked[key] = _Tracked(list(chain), tuple(roots), teardown)

        def release() -> None:
            self._tracked.pop(key, None)

        return release

    def replace(self, crls: Sequence[x509.CertificateRevocationList]) -> int:
        """Install new CRLs, then re-check every live session and tear down the revoked ones.

        Returns how many were torn down."""
        self._install(crls)
        torn = 0
        for key, entry in list(self._tracked.items()):
            err = self.revoked(entry.chain, entry.roots)
            if err is None:
                continue
            self._tracked.pop(key, None)
            torn += 1
            self._rejected()
            try:
                entry.teardown(err)
            except Exception:
                log.exception("hbone: tearing down a revoked session failed")
        return torn

    def _rejected(self) -> None:
        if self._on_rejection is not None:
            self._on_rejection()

    def _valid_signature(self, crl: x509.CertificateRevocationList, issuer: x509.Certificate) -> bool:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec, rsa

        key = (id(crl), issuer.fingerprint(hashes.SHA256()))
        ok = self._signature_ok.get(key)
        if ok is None:
            public_key = issuer.public_key()
            ok = isinstance(
                public_key, ec.EllipticCurvePublicKey | rsa.RSAPublicKey
            ) and crl.is_signature_valid(public_key)
            self._signature_ok[key] = ok
        return ok


def _find_issuer(
    cert: x509.Certificate, rest: Sequence[x509.Certificate], roots: Sequence[x509.Certificate]
) -> x509.Certificate | None:
    for candidate in (*rest, *roots):
        if candidate.subject == cert.issuer:
            return candidate
    return None


def uri_sans(leaf: x509.Certificate) -> list[str]:
    """URI SANs of a certificate, in certificate order (empty without a SubjectAltName)."""
    from cryptography import x509

    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(san.get_values_for_type(x509.UniformResourceIdentifier))


def peer_identities(peer: TlsPeer) -> list[Identity]:
    """The peer leaf's URI SANs that parse as SPIFFE identities, in certificate order."""
    return peer.identities


def check_alpn(peer: TlsPeer) -> None:
    if peer.alpn != ALPN_H2:
        raise TlsHandshakeError(f"tls handshake error: ALPN negotiated {peer.alpn!r}, expected 'h2'")


def check_server_identity(peer: TlsPeer, expected: Sequence[Identity]) -> Identity:
    """Client side: any URI SAN of the server leaf must equal any expected identity.

    Returns the server's identity (its first SPIFFE SAN); raises `IdentityMismatch`.
    """
    got = peer.identities
    wanted = set(expected)
    if not any(i in wanted for i in got):
        raise IdentityMismatch(expected, got)
    return got[0]


def check_client_trust_domain(peer: TlsPeer, trust_domain: str) -> Identity:
    """Server side: the client leaf must have a SPIFFE SAN in our trust domain.

    Returns the client's identity (its first SPIFFE SAN); raises `TlsHandshakeError`.
    """
    got = peer.identities
    if not any(i.trust_domain == trust_domain for i in got):
        raise TlsHandshakeError(
            f"tls handshake error: client identity {[str(i) for i in got]} is not in trust domain {trust_domain!r}"
        )
    return got[0]
