"""OpenSSL's tables filled before the workers are forked, so that they share them."""

from __future__ import annotations

import ssl

from hbone.keyfile import load_pem_pair
from hbone.tls import ALPN_H2

# A key pair for `warm_up` only: published here, so worthless; no context built from it is kept.
_WARM_UP_KEY = b"""-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgplJSdtT42TIcQooB
J9Tt7BElyDPODAW4vOHCRDorBS+hRANCAASzMtoymfXUNV2XTipxlfooiD+i5UGD
QLzEDRzJQlxpMZ+Yg1+4uGLnmEXQwaYg3m/LyApKFmOZm+FVe8ALTori
-----END PRIVATE KEY-----
"""
_WARM_UP_CERT = b"""-----BEGIN CERTIFICATE-----
MIIBOzCB4aADAgECAgEBMAoGCCqGSM49BAMCMCcxJTAjBgNVBAMMHGhib25lIHdh
cm0tdXAsIG5ldmVyIHRydXN0ZWQwHhcNMjYwMTAxMDAwMDAwWhcNMjYwMTAyMDAw
MDAwWjAnMSUwIwYDVQQDDBxoYm9uZSB3YXJtLXVwLCBuZXZlciB0cnVzdGVkMFkw
EwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEszLaMpn11DVdl04qcZX6KIg/ouVBg0C8
xA0cyUJcaTGfmINfuLhi55hF0MGmIN5vy8gKShZjmZvhVXvAC06K4jAKBggqhkjO
PQQDAgNJADBGAiEAgATYqDPp+yenUmucf3pu2rZQiGskagIcK8aaa4uQ1icCIQCP
DEQ1WdktbUsgfMNFhzsVj5R3FIej3DIZCvW2ZX6K9g==
-----END CERTIFICATE-----
"""


def warm_up() -> None:
    """Build and drop a server and a client context as `TlsCredentials.build` does, from a
    throwaway EC key pair. A process's first context fills OpenSSL's tables of algorithms, PEM
    decoders and key types (kept for the process's life); done before a fork, every forked process
    shares those tables instead of building its own copy (a proxy with two workers: about 1 MiB
    less PSS at rest)."""
    for protocol in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.set_alpn_protocols([ALPN_H2])
        ctx.load_verify_locations(cadata=_WARM_UP_CERT.decode("ascii"))
        load_pem_pair(ctx, _WARM_UP_KEY, _WARM_UP_CERT)
