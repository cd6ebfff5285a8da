"""The fake CA's certificates and the secret manager: sharing, rotation, failures and the dump."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import random
import ssl
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store
from prometheus_client.parser import text_string_to_metric_families

from hbone.identity import Identity
from hbone.tls import TlsPolicy, WorkloadCertificate
from tests.waiting import eventually_async
from ztunnel.identity.certificates import CaError, CertificateUnavailable, FakeCA, SecretManager
from ztunnel.metrics.certs import CertExpiry
from ztunnel.metrics.exposition import render_openmetrics
from ztunnel.metrics.families import Metrics

CLIENT = Identity("cluster.local", "demo", "client")
SERVER = Identity("cluster.local", "demo", "server")
BROKEN = Identity("error", "forgotten", "sa")
T0 = datetime(2030, 1, 1, tzinfo=UTC).timestamp()


def leaf(cert: WorkloadCertificate) -> x509.Certificate:
    return x509.load_pem_x509_certificate(cert.chain_pem[0])


# --- fake CA ---


def test_fake_ca_leaf() -> None:
    now = datetime(2030, 1, 1, 12, 0, 0, 500, tzinfo=UTC)
    cert = FakeCA().issue(CLIENT, now)
    c = leaf(cert)
    assert len(cert.chain_pem) == 1
    assert c.subject == x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cluster.local")])
    assert c.issuer == c.subject  # the root's subject is O=cluster.local too
    san = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert list(san) == [x509.UniformResourceIdentifier("spiffe://cluster.local/ns/demo/sa/client")]
    ku = c.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.digital_signature and ku.key_encipherment and not ku.key_cert_sign
    eku = c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert c.not_valid_before_utc == datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert c.not_valid_after_utc - c.not_valid_before_utc == timedelta(hours=24)
    assert (cert.not_before, cert.not_after) == (c.not_valid_before_utc, c.not_valid_after_utc)
    assert 0 < c.serial_number < 2**159
    assert cert.identity == CLIENT


def test_fake_ca_key_is_pkcs8_p256_matching_the_leaf() -> None:
    cert = FakeCA().issue(CLIENT)
    assert cert.key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")
    key = serialization.load_pem_private_key(cert.key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert isinstance(key.curve, ec.SECP256R1)
    assert key.public_key() == leaf(cert).public_key()


def test_fake_ca_chains_to_the_embedded_root() -> None:
    ca = FakeCA()
    cert = ca.issue(SERVER)
    roots = x509.load_pem_x509_certificates(b"".join(cert.roots_pem))
    assert cert.roots_pem == (ca.root_pem,)
    # Another FakeCA (another process) trusts it: same embedded root.
    store = Store(x509.load_pem_x509_certificates(FakeCA().root_pem))
    verifier = PolicyBuilder().store(store).time(datetime.now(UTC)).build_client_verifier()
    verified = verifier.verify(leaf(cert), [])
    assert verified.chain[-1] == roots[0]
    assert [str(s.value) for s in verified.subjects or []] == [str(SERVER)]


def test_fake_ca_serials_and_keys_are_fresh() -> None:
    ca = FakeCA()
    a, b = ca.issue(CLIENT), ca.issue(CLIENT)
    assert leaf(a).serial_number != leaf(b).serial_number
    assert a.key_pem != b.key_pem


def test_fake_ca_failure_hook() -> None:
    with pytest.raises(CaError):
        FakeCA().issue(BROKEN)
    FakeCA().issue(Identity("error", "other", "sa"))


# --- secret manager ---


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class CountingCA:
    """A FakeCA on the test clock that counts calls, can be made to fail, and can be held."""

    def __init__(self, clock: Clock) -> None:
        self.fake = FakeCA(clock=clock)
        self.calls: list[Identity] = []
        self.fail: str | None = None
        self.gate: asyncio.Event | None = None

    async def fetch(self, identity: Identity) -> WorkloadCertificate:
        self.calls.append(identity)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise CaError(self.fail)
        return await self.fake.fetch(identity)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ca(clock: Clock) -> CountingCA:
    return CountingCA(clock)


async def test_concurrent_gets_share_one_fetch(clock: Clock, ca: CountingCA) -> None:
    sm = SecretManager(ca, clock=clock)
    ca.gate = asyncio.Event()
    waiters = [asyncio.create_task(sm.get(CLIENT)) for _ in range(20)]
    await asyncio.sleep(0)
    assert sm.dump()[0]["state"] == "Initializing"
    ca.gate.set()
    certs = await asyncio.gather(*waiters)
    assert ca.calls == [CLIENT]
    assert all(c is certs[0] for c in certs)
    assert await sm.get(CLIENT) is certs[0]
    assert ca.calls == [CLIENT]
    await sm.close()


async def test_prefetch_then_get_uses_the_prefetched_cert(clock: Clock, ca: CountingCA) -> None:
    sm = SecretManager(ca, clock=clock)
    sm.prefetch(SERVER)
    sm.prefetch(SERVER)
    cert = await sm.get(SERVER)
    assert ca.calls == [SERVER]
    assert cert.identity == SERVER
    await sm.close()


async def test_rotation_at_half_life(clock: Clock, ca: CountingCA) -> None:
    sm = SecretManager(ca, clock=clock)
    first = await sm.get(CLIENT)
    half_life = T0 + 12 * 3600
    clock.now = half_life - 1
    assert await sm.refresh_due() == []
    clock.now = half_life
    assert await sm.refresh_due() == [CLIENT]
    second = await sm.get(CLIENT)
    assert second is not first
    assert second.not_before.timestamp() == half_life
    assert ca.calls == [CLIENT, CLIENT]
    await sm.close()


async def test_refresh_failure_keeps_the_valid_cert_and_backs_off(clock: Clock, ca: CountingCA) -> None:
    sm = SecretManager(ca, clock=clock, rng=random.Random(1))
    first = await sm.get(CLIENT)
    ca.fail = "CA down"
    clock.now = T0 + 12 * 3600
    await sm.refresh_due()
    assert await sm.get(CLIENT) is first
    assert sm.dump()[0]["state"] == "Available"
    # Next retry ≈1 s later (±20 %), then ≈2 s.
    clock.now += 0.79
    assert await sm.refresh_due() == []
    clock.now += 0.42
    assert await sm.refresh_due() == [CLIENT]
    clock.now += 1.59
    assert await sm.refresh_due() == []
    clock.now += 0.82
    assert await sm.refresh_due() == [CLIENT]
    ca.fail = None
    clock.now += 5
    assert await sm.refresh_due() == [CLIENT]
    assert await sm.get(CLIENT) is not first
    await sm.close()


async def test_retry_never_waits_past_expiry(clock: Clock, ca: CountingCA) -> None:
    sm = SecretManager(ca, clock=clock, rng=random.Random(1))
    await sm.get(CLIENT)
    ca.fail = "CA down"
    clock.now = T0 + 24 * 3600 - 0.5
    assert await sm.refresh_due() == [CLIENT]
    assert sm.dump()[0]["state"] == "Available"
    clock.now = T0 + 24 * 3600
    assert await sm.refresh_due() == [CLIENT]
    assert sm.dump()[0]["state"] == "Unavailable: CA down"
    with pytest.raises(CertificateUnavailable, match="CA down"):
        await sm.get(CLIENT)
    await sm.close()


async def test_unavailable_when_the_ca_fails_and_there_is_no_cert(clock: Clock, ca: CountingCA) -> None:
    sm = SecretManager(FakeCA(clock=clock), clock=clock)
    with pytest.raises(CertificateUnavailable, match="simulated CA failure"):
        await sm.get(BROKEN)
    [entry] = sm.dump()
    assert entry["state"] == f"Unavailable: simulated CA failure for {BROKEN}"
    assert entry["certChain"] == [] and entry["rootCerts"] == []
    # A later caller gets the error at once, until the scheduled retry.
    with pytest.raises(CertificateUnavailable):
        await sm.get(BROKEN)
    await sm.close()


async def test_unavailable_recovers_on_retry(clock: Clock, ca: CountingCA) -> None:
    sm = SecretManager(ca, clock=clock)
    ca.fail = "no token"
    with pytest.raises(CertificateUnavailable, match="no token"):
        await sm.get(CLIENT)
    ca.fail = None
    clock.now += 2
    assert await sm.refresh_due() == [CLIENT]
    assert sm.dump()[0]["state"] == "Available"
    assert (await sm.get(CLIENT)).identity == CLIENT
    await sm.close()


async def test_forget_drops_the_cert_and_fails_waiters(clock: Clock, ca: CountingCA) -> None:
    sm = SecretManager(ca, clock=clock)
    await sm.get(CLIENT)
    sm.forget(CLIENT)
    assert sm.dump() == []
    ca.gate = asyncio.Event()
    waiter = asyncio.create_task(sm.get(SERVER))
    await asyncio.sleep(0)
    sm.forget(SERVER)
    with pytest.raises(CertificateUnavailable, match="forgotten"):
        await waiter
    clock.now = T0 + 13 * 3600
    assert await sm.refresh_due() == []
    await sm.close()


async def test_background_rotation_runs_on_its_own() -> None:
    # Real time, with a cert whose half-life is a few milliseconds away.
    class ShortLived:
        def __init__(self) -> None:
            self.calls = 0
            self.fake = FakeCA()

        async def fetch(self, identity: Identity) -> WorkloadCertificate:
            self.calls += 1
            now = datetime.now(UTC)
            cert = self.fake.issue(identity, now)
            return WorkloadCertificate(
                cert.identity,
                cert.chain_pem,
                cert.key_pem,
                cert.roots_pem,
                now,
                now + timedelta(milliseconds=40),
            )

    ca = ShortLived()
    sm = SecretManager(ca)
    await sm.get(CLIENT)
    await eventually_async(lambda: ca.calls >= 3, "two renewals of the short-lived certificate")
    assert ca.calls >= 3
    await sm.close()


async def test_dump_format(clock: Clock, ca: CountingCA) -> None:
    sm = SecretManager(ca, clock=clock)
    await sm.get(SERVER)
    await sm.get(CLIENT)
    ca.gate = asyncio.Event()
    pending = Identity("cluster.local", "a", "pending")
    sm.prefetch(pending)
    await asyncio.sleep(0)
    dump = sm.dump()
    assert [d["identity"] for d in dump] == sorted([str(CLIENT), str(SERVER), str(pending)])
    assert dump[0] == {"identity": str(pending), "state": "Initializing", "certChain": [], "rootCerts": []}
    client = dump[1]
    assert client["identity"] == "spiffe://cluster.local/ns/demo/sa/client"
    assert client["state"] == "Available"
    [chain] = client["certChain"]
    cert = x509.load_pem_x509_certificate(base64.b64decode(chain["pem"]))
    assert chain["serialNumber"] == str(cert.serial_number)
    assert chain["validFrom"] == "2030-01-01T00:00:00Z"
    assert chain["expirationTime"] == "2030-01-02T00:00:00Z"
    [root] = client["rootCerts"]
    assert base64.b64decode(root["pem"]) == FakeCA().root_pem
    assert root["expirationTime"] == "2099-12-31T23:59:59Z"
    ca.gate.set()
    await sm.close()


async def test_at_most_eight_ca_calls_at_once(clock: Clock, ca: CountingCA) -> None:
    sm = SecretManager(ca, clock=clock)
    ca.gate = asyncio.Event()
    ids = [Identity("cluster.local", "ns", f"sa{i}") for i in range(12)]
    for i in ids[:11]:
        sm.prefetch(i)
    realtime = asyncio.create_task(sm.get(ids[11]))
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(ca.calls) == 8
    ca.gate.set()
    await realtime
    # The connection's fetch went ahead of the queued prefetches.
    assert ca.calls.index(ids[11]) == 8
    await sm.close()


# --- TLS credentials (the contexts come with the certificate) ---


async def test_credentials_are_built_once_per_certificate_and_anew_on_rotation(
    clock: Clock, ca: CountingCA
) -> None:
    sm = SecretManager(ca, clock=clock, tls=TlsPolicy(tls12=True))
    first = await sm.credentials(CLIENT)
    assert await sm.credentials(CLIENT) is first  # no context is built per handshake
    assert first.cert is await sm.get(CLIENT)
    assert first.server.minimum_version == ssl.TLSVersion.TLSv1_2  # built under the manager's policy
    clock.now = T0 + 12 * 3600
    assert await sm.refresh_due() == [CLIENT]
    second = await sm.credentials(CLIENT)
    assert second is not first and second.cert.not_before.timestamp() == clock.now
    assert second.server is not first.server
    await sm.close()


async def test_unusable_certificate_material_is_a_fetch_failure(clock: Clock, ca: CountingCA) -> None:
    class NoRoots(CountingCA):
        async def fetch(self, identity: Identity) -> WorkloadCertificate:
            cert = await super().fetch(identity)
            return dataclasses.replace(cert, roots_pem=(b"",))

    sm = SecretManager(NoRoots(clock), clock=clock)
    with pytest.raises(CertificateUnavailable, match="has no trust roots"):
        await sm.credentials(CLIENT)
    assert sm.dump()[0]["state"].startswith("Unavailable")
    await sm.close()


async def test_expiry_follows_fetches_rotations_and_forget(clock: Clock, ca: CountingCA) -> None:
    """What `istio_cert_expiry_seconds` shows: each held identity's last fetched NotAfter."""
    sm = SecretManager(ca, clock=clock, rng=random.Random(1))
    metrics = Metrics(process_metrics=False)
    metrics.registry.register(CertExpiry(sm.expiries))

    def shown() -> dict[str, float]:
        text = render_openmetrics(metrics.registry).decode()
        return {
            s.labels["identity"]: s.value
            for family in text_string_to_metric_families(text)
            if family.name == "istio_cert_expiry_seconds"
            for s in family.samples
        }

    assert shown() == {}
    first = await sm.get(CLIENT)
    ca.gate = asyncio.Event()
    sm.prefetch(SERVER)  # not fetched yet: no series
    assert shown() == {str(CLIENT): first.not_after.timestamp()} == {str(CLIENT): T0 + 24 * 3600}
    ca.gate.set()
    await sm.get(SERVER)
    ca.gate = None
    # Rotation: the new certificate's NotAfter.
    clock.now = T0 + 12 * 3600
    await sm.refresh_due()
    assert shown()[str(CLIENT)] == (await sm.get(CLIENT)).not_after.timestamp() == T0 + 36 * 3600
    # Refreshes failing past expiry: the last NotAfter stays (an alert on it fires).
    ca.fail = "CA down"
    clock.now = T0 + 36 * 3600
    await sm.refresh_due()
    assert sm.dump()[0]["state"].startswith("Unavailable")
    assert shown()[str(CLIENT)] == T0 + 36 * 3600
    sm.forget(CLIENT)
    assert list(shown()) == [str(SERVER)]
    await sm.close()
