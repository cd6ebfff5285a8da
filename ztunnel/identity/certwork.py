"""The certificate operations that need cryptography, over plain data, and the helper process that runs
them (`python -m ztunnel.identity.certwork`).

Each operation takes and returns JSON values only (str, int, bool, lists and dicts of them; PEM as
text, times as ISO 8601), so that it runs the same in this process or in the helper:

* `fake_issue`: the fake CA's leaf for an identity at a time (the embedded test root signs);
* `new_key`: a fresh ECDSA P-256 key (PKCS#8 PEM) and the PEM CSR istiod expects for an identity;
* `check_chain`: a CA's response chain checked against the key and identity asked for;
* `describe`: what `/config_dump` shows of each certificate of some PEM blocks.

A certificate (`fake_issue`, `check_chain`) comes back as `chain`, `key`, `roots` (PEM text),
`notBefore`, `notAfter` and, computed here with it, `chainInfo` and `rootInfo` (`describe` of the
chain and of the roots). A failure is a `CertWorkError` whose message is the CA error's.

The helper reads one request a line on stdin (`{"id", "op", "args"}`) and writes one answer a line
on stdout (`{"id", "result"}` or `{"id", "error"}`), in order, as it takes requests one after the
other. When none came for `--linger` seconds it writes `{"bye": true}` and exits: a request written
after that was never read, and its sender asks again. It also exits when stdin closes, and dies
with its parent.

cryptography is imported inside the operations: importing this module (for `CertWorkError`) costs
nothing, so the proxy's parent, which runs these in the helper, never maps it.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import select
import sys
import traceback
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

FAKE_CA_VALIDITY = timedelta(hours=24)
LINGER = 2.0

JsonDict = dict[str, Any]


class CertWorkError(Exception):
    """A certificate operation failed; the message is what the CA error says."""


# --- the fake CA ---------------------------------------------------------------------------------


@functools.cache
def _embedded_root() -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = serialization.load_pem_private_key(embedded_file("ca-key.pem"), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TypeError("embedded test CA key is not an EC key")
    root_pem = embedded_file("root-cert.pem")
    return key, x509.load_pem_x509_certificate(root_pem), root_pem


def embedded_file(name: str) -> bytes:
    """A file of the embedded test CA (`ztunnel/testdata`)."""
    from importlib import resources

    return (resources.files("ztunnel") / "testdata").joinpath(name).read_bytes()


def fake_issue(identity: str, not_before: int) -> JsonDict:
    """The fake CA's leaf for `identity`, valid `FAKE_CA_VALIDITY` from `not_before` (Unix seconds:
    X.509 times have whole seconds)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from hbone.identity import build_leaf

    root_key, root, root_pem = _embedded_root()
    start = datetime.fromtimestamp(not_before, UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cluster.local")])
    cert = build_leaf(
        [identity], key.public_key(), root, root_key, start, start + FAKE_CA_VALIDITY, subject=subject
    )
    return _certificate(
        [cert.public_bytes(serialization.Encoding.PEM).decode("ascii")],
        _key_pem(key),
        [root_pem.decode("ascii")],
        cert,
    )


# --- the gRPC CA's side --------------------------------------------------------------------------


def certificate_request(identity: str, key: ec.EllipticCurvePrivateKey) -> bytes:
    """The PEM CSR istiod expects: empty subject, one critical URI SAN, SHA-256."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity)]), critical=True)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def new_key(identity: str) -> JsonDict:
    """A fresh ECDSA P-256 key (`key`, PKCS#8 PEM) and its CSR for `identity` (`csr`, PEM)."""
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    return {"key": _key_pem(key), "csr": certificate_request(identity, key).decode("ascii")}


def check_chain(target: str, identity: str, key: str, chain: list[str], impersonate: bool) -> JsonDict:
    """The certificate in a CA's response `chain` (leaf, intermediates, then the trust bundle) for the
    `key` (PEM) asked with; in shared mode (`impersonate`) the leaf must name `identity`. `target`
    names the CA in the errors."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from hbone.tls import uri_sans

    if not chain:
        raise CertWorkError(f"CA {target} returned an empty certificate chain for {identity}")
    if len(chain) < 2:
        raise CertWorkError(f"CA {target} returned no root certificate for {identity}")
    try:
        leaf = x509.load_pem_x509_certificates(chain[0].encode())[0]
        for pem in chain[1:]:
            x509.load_pem_x509_certificates(pem.encode())
    except ValueError as e:
        raise CertWorkError(f"CA {target} returned an invalid certificate: {e}") from None
    private = serialization.load_pem_private_key(key.encode(), password=None)
    if leaf.public_key() != private.public_key():
        raise CertWorkError(f"CA {target} returned a certificate for another key")
    if impersonate and identity not in uri_sans(leaf):
        raise CertWorkError(f"did not find expected SAN {identity} in the certificate from {target}")
    return _certificate([_pem_line(pem) for pem in chain[:-1]], key, [_pem_line(chain[-1])], leaf)


def _pem_line(pem: str) -> str:
    return pem if pem.endswith("\n") else pem + "\n"


# --- what /config_dump shows ---------------------------------------------------------------------


def describe(pems: list[str]) -> list[dict[str, str]]:
    """Each certificate of the PEM blocks `pems` (several may be in one), in order: `pem` (base64 of
    its PEM), `serialNumber` (decimal), `validFrom` and `expirationTime` (RFC 3339, UTC)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    out = []
    for pem in pems:
        for cert in x509.load_pem_x509_certificates(pem.encode()):
            out.append(
                {
                    "pem": base64.b64encode(cert.public_bytes(serialization.Encoding.PEM)).decode("ascii"),
                    "serialNumber": str(cert.serial_number),
                    "validFrom": _rfc3339(cert.not_valid_before_utc),
                    "expirationTime": _rfc3339(cert.not_valid_after_utc),
                }
            )
    return out


def _rfc3339(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _certificate(chain: list[str], key: str, roots: list[str], leaf: x509.Certificate) -> JsonDict:
    return {
        "chain": chain,
        "key": key,
        "roots": roots,
        "notBefore": leaf.not_valid_before_utc.isoformat(),
        "notAfter": leaf.not_valid_after_utc.isoformat(),
        "chainInfo": describe(chain),
        "rootInfo": describe(roots),
    }


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    from cryptography.hazmat.primitives import serialization

    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return pem.decode("ascii")


# --- running them ------------------------------------------------------------------------------

OPERATIONS: dict[str, Callable[..., Any]] = {
    "fake_issue": fake_issue,
    "new_key": new_key,
    "check_chain": check_chain,
    "describe": describe,
}


def perform(op: str, args: JsonDict) -> Any:
    """Run operation `op` with `args`; raise CertWorkError, also for an unknown operation, bad
    arguments or an unexpected failure (whose traceback goes to stderr)."""
    function = OPERATIONS.get(op)
    if function is None:
        raise CertWorkError(f"unknown certificate operation {op!r}")
    try:
        return function(**args)
    except CertWorkError:
        raise
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        raise CertWorkError(f"certificate operation {op} failed: {type(e).__name__}: {e}") from None


def answer(line: bytes) -> bytes:
    """The helper's answer line to one request line."""
    try:
        request = json.loads(line)
        reply: JsonDict = {"id": request["id"]}
        reply["result"] = perform(request["op"], request.get("args", {}))
    except CertWorkError as e:
        reply["error"] = str(e)
    except (ValueError, KeyError, TypeError) as e:  # not a request: the parent's bug, said once
        reply = {"id": None, "error": f"malformed request to the certificate helper: {e}"}
    return json.dumps(reply).encode() + b"\n"


def serve(fd_in: int, fd_out: int, linger: float) -> int:
    """Answer the request lines of `fd_in` on `fd_out` until it closes (exit code 0), or until no
    request came for `linger` seconds (after saying `bye`)."""
    pending = b""
    while True:
        while (end := pending.find(b"\n")) >= 0:
            line, pending = pending[:end], pending[end + 1 :]
            if line.strip():
                _write_all(fd_out, answer(line))
        readable, _, _ = select.select([fd_in], [], [], linger)
        if not readable and not pending:
            _write_all(fd_out, b'{"bye": true}\n')
            return 0
        if readable:
            data = os.read(fd_in, 1 << 16)
            if not data:
                return 0
            pending += data


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def main(argv: list[str]) -> int:
    import signal

    from ztunnel.lifecycle import set_pdeathsig

    linger = float(argv[argv.index("--linger") + 1]) if "--linger" in argv else LINGER
    set_pdeathsig(signal.SIGKILL)  # die with the parent, as a worker does
    try:
        return serve(sys.stdin.fileno(), sys.stdout.fileno(), linger)
    except BrokenPipeError:
        return 0  # the parent stopped listening


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
