"""The gRPC CA client: workload certificates from `IstioCertificateService/CreateCertificate`.

For each fetch: a fresh ECDSA P-256 key (it never leaves the proxy's processes), a PEM PKCS#10
request with an empty subject and one critical SubjectAltName holding the SPIFFE URI, signed with
SHA-256, asking for `SECRET_TTL` of validity. The key, the request and the checks of the answer are
made where `work` says (`ztunnel/identity/certhelper.py`): the proxy's parent has its helper process make
them, so that it never loads cryptography itself. In shared mode the proxy signs in for other
identities with its own token, so the request carries `ImpersonatedIdentity` in its metadata and
the returned leaf must name the identity asked for. The response chain is leaf, intermediates, and
last the trust bundle (which may hold several roots; one that holds no certificate is refused, never
read as "trust nothing"). Every failure raises `CaError` with a message naming the CA and the reason.

The channel (our own gRPC client, `xds.grpc`), TLS roots and per-call headers are those of the xDS
client (`xds.channel`); with https the
root certificate is read again before each request and the channel rebuilt when it changed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from google.protobuf.message import DecodeError

from hbone.identity import Identity
from xds.channel import (
    AuthToken,
    Channel,
    ControlPlaneAddress,
    ControlPlaneError,
    call_metadata,
    open_channel,
    read_root_ca,
)
from xds.gen.istio.v1.auth import ca_pb2
from xds.grpc.wire import RpcError, StatusCode
from ztunnel.identity.certhelper import CertWork, InProcess, IssuedCertificate
from ztunnel.identity.certificates import CaError
from ztunnel.identity.certwork import CertWorkError

log = logging.getLogger(__name__)

IMPERSONATED_IDENTITY = "ImpersonatedIdentity"
DEFAULT_CALL_TIMEOUT = 60.0
CREATE_CERTIFICATE_PATH = "/istio.v1.auth.IstioCertificateService/CreateCertificate"


class GrpcCaClient:
    """`ztunnel.identity.certificates.CaClient` over gRPC."""

    def __init__(
        self,
        address: str,
        *,
        root_ca: str | None = None,
        alt_hostname: str | None = None,
        token: AuthToken | None = None,
        cluster_id: str = "Kubernetes",
        headers: Sequence[tuple[str, str]] = (),
        secret_ttl: float = 86400.0,
        impersonate: bool = False,
        call_timeout: float | None = DEFAULT_CALL_TIMEOUT,
        work: CertWork | None = None,
    ) -> None:
        """`address`: `http://host:port` or `https://host:port` (raises CaError when invalid);
        `root_ca`: the `CA_ROOT_CA` setting; `impersonate`: shared mode; `work`: where the key is made
        and the answer checked (default: in this process)."""
        try:
            self.address = ControlPlaneAddress.parse(address)
        except ControlPlaneError as e:
            raise CaError(str(e)) from None
        self._root_ca = root_ca
        self._alt_hostname = alt_hostname
        self._token = token
        self._cluster_id = cluster_id
        self._headers = tuple(headers)
        self._secret_ttl = secret_ttl
        self._impersonate = impersonate
        self._call_timeout = call_timeout
        self._work = work or InProcess()
        self._channel: Channel | None = None
        self._channel_roots: bytes | None = None

    async def fetch(self, identity: Identity) -> IssuedCertificate:
        try:
            key = await self._work.new_key(identity)
        except CertWorkError as e:
            raise CaError(f"CA {self.address.target}: {e}") from None
        request = ca_pb2.IstioCertificateRequest(
            csr=key.csr_pem.decode("ascii"), validity_duration=int(self._secret_ttl)
        )
        if self._impersonate:
            request.metadata.update({IMPERSONATED_IDENTITY: str(identity)})
        try:
            channel = await self._current_channel()
            metadata = call_metadata(self._token, self._cluster_id, self._headers)
        except ControlPlaneError as e:
            raise CaError(f"CA {self.address.target}: {e}") from None
        try:
            answer = await channel.unary(
                CREATE_CERTIFICATE_PATH, request.SerializeToString(), metadata, self._call_timeout
            )
            response = ca_pb2.IstioCertificateResponse.FromString(answer)
        except RpcError as e:
            what = "unreachable" if e.code is StatusCode.UNAVAILABLE else "refused the request"
            raise CaError(
                f"CA {self.address.target} {what}: {e.code.name}: {e.details or 'no details'}"
            ) from None
        except DecodeError as e:
            raise CaError(f"CA {self.address.target} sent an undecodable response: {e}") from None
        try:
            cert = await self._work.check_chain(
                self.address.target, identity, key.key_pem, response.cert_chain, impersonate=self._impersonate
            )
        except CertWorkError as e:
            raise CaError(str(e)) from None
        log.debug(
            "received certificate",
            extra={"fields": {"identity": str(identity), "expiry": cert.not_after.isoformat()}},
        )
        return cert

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def _current_channel(self) -> Channel:
        # A changed root file (a ConfigMap swap) takes a new channel; reading it costs little next
        # to a CSR signature.
        roots = read_root_ca(self._root_ca) if self.address.tls and self._root_ca is not None else None
        if self._channel is not None and roots != self._channel_roots:
            log.info("CA root certificate changed, reconnecting")
            await self.close()
        if self._channel is None:
            self._channel = open_channel(self.address, self._root_ca, self._alt_hostname)
            self._channel_roots = roots
        return self._channel
