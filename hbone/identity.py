"""SPIFFE identities: `spiffe://<trust domain>/ns/<namespace>/sa/<service account>`."""

from __future__ import annotations

from dataclasses import dataclass

SPIFFE_PREFIX = "spiffe://"


@dataclass(frozen=True, slots=True)
class Identity:
    trust_domain: str
    namespace: str
    service_account: str

    @classmethod
    def parse(cls, uri: str) -> Identity:
        """Parse a SPIFFE URI; raise ValueError when it is not of the SPIFFE workload form.

        Only a URI that splits into exactly five `/`-separated parts after the scheme, whose second
        and fourth parts are `ns` and `sa`, is an identity (SPEC §2.3).
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
