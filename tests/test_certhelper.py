"""The certificate operations in a helper process: the same answers as in this process, requests
queued at once, the helper gone after its linger and started again, a helper killed mid-request
failing that request only, its stderr in our log."""

from __future__ import annotations

import asyncio
import base64
import fcntl
import logging
import os
import signal
import struct
import subprocess
import sys
import termios
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from hbone.identity import Identity
from tests.apps import echo_roundtrip, loopback_net, sha, start_echo, workload_yaml
from tests.certs import make_ca
from tests.harness import Fleet, proxy_env
from tests.waiting import eventually_async
from ztunnel.identity.certhelper import CertHelper, InProcess, IssuedCertificate
from ztunnel.identity.certificates import CaError, CertificateUnavailable, FakeCA, SecretManager
from ztunnel.identity.certwork import CertWorkError

pytestmark = pytest.mark.timeout(60)

CLIENT = Identity("cluster.local", "demo", "client")
OTHER = Identity("cluster.local", "demo", "other")
TARGET = "istiod.istio-system.svc:15012"
T0 = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.fixture
async def helper() -> AsyncIterator[CertHelper]:
    work = CertHelper(linger=0.5)
    try:
        yield work
    finally:
        await work.close()


def gone(pid: int) -> bool:
    """The process exited and was reaped (its /proc entry is gone)."""
    return not os.path.exists(f"/proc/{pid}")


# --- the same answers in both places ---------------------------------------------------------------


async def test_describe_and_check_chain_answer_as_in_process(helper: CertHelper) -> None:
    cert = FakeCA().issue(CLIENT, T0)
    pems = [*cert.chain_pem, *cert.roots_pem]
    assert await helper.describe(pems) == await InProcess().describe(pems)
    chain = [p.decode() for p in pems]
    here = await InProcess().check_chain(TARGET, CLIENT, cert.key_pem, chain, impersonate=True)
    there = await helper.check_chain(TARGET, CLIENT, cert.key_pem, chain, impersonate=True)
    assert there == here
    assert there.chain_pem == cert.chain_pem and there.roots_pem == cert.roots_pem
    assert (there.not_before, there.not_after) == (cert.not_before, cert.not_after)
    [leaf] = there.chain_info
    assert leaf["serialNumber"] == str(x509.load_pem_x509_certificate(cert.chain_pem[0]).serial_number)
    assert (leaf["validFrom"], leaf["expirationTime"]) == ("2030-01-01T00:00:00Z", "2030-01-02T00:00:00Z")


async def test_check_chain_refuses_as_in_process_with_the_same_messages(helper: CertHelper) -> None:
    cert = FakeCA().issue(CLIENT, T0)
    leaf, root = cert.chain_pem[0].decode(), cert.roots_pem[0].decode()
    another_key = FakeCA().issue(CLIENT, T0).key_pem
    cases = [
        (cert.key_pem, [], True, f"CA {TARGET} returned an empty certificate chain for {CLIENT}"),
        (cert.key_pem, [leaf], True, f"CA {TARGET} returned no root certificate for {CLIENT}"),
        (cert.key_pem, ["not a certificate", root], True, f"CA {TARGET} returned an invalid certificate"),
        (another_key, [leaf, root], True, f"CA {TARGET} returned a certificate for another key"),
        (cert.key_pem, [leaf, root], True, f"did not find expected SAN {OTHER} in the certificate from"),
    ]
    for key, chain, impersonate, message in cases:
        identity = OTHER if "expected SAN" in message else CLIENT
        errors = []
        for work in (InProcess(), helper):
            with pytest.raises(CertWorkError) as caught:
                await work.check_chain(TARGET, identity, key, chain, impersonate=impersonate)
            errors.append(str(caught.value))
        assert errors[0] == errors[1] and errors[0].startswith(message), errors


async def test_fake_issue_and_new_key_give_material_this_process_accepts(helper: CertHelper) -> None:
    here = await InProcess().fake_issue(CLIENT, T0)
    there = await helper.fake_issue(CLIENT, T0)
    assert isinstance(there, IssuedCertificate)
    assert (there.identity, there.not_before, there.not_after) == (
        here.identity,
        here.not_before,
        here.not_after,
    )
    assert there.roots_pem == here.roots_pem and there.root_info == here.root_info
    assert there.chain_pem != here.chain_pem and there.key_pem != here.key_pem  # fresh key and serial
    # This process checks what the helper made, and describes it as the helper did.
    chain = [p.decode() for p in (*there.chain_pem, *there.roots_pem)]
    checked = await InProcess().check_chain(TARGET, CLIENT, there.key_pem, chain, impersonate=True)
    assert checked.chain_info == there.chain_info

    key = await helper.new_key(CLIENT)
    csr = x509.load_pem_x509_csr(key.csr_pem)
    private = serialization.load_pem_private_key(key.key_pem, password=None)
    assert csr.is_signature_valid and csr.public_key() == private.public_key()
    san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.critical and san.value.get_values_for_type(x509.UniformResourceIdentifier) == [str(CLIENT)]
    local = await InProcess().new_key(CLIENT)
    assert key.key_pem.splitlines()[0] == local.key_pem.splitlines()[0] == b"-----BEGIN PRIVATE KEY-----"


async def test_the_fake_ca_over_the_helper_issues_what_it_issues_in_process(helper: CertHelper) -> None:
    ca = FakeCA(work=helper, clock=lambda: T0.timestamp() + 0.7)
    cert = await ca.fetch(CLIENT)
    assert (cert.not_before, cert.not_after) == (T0, FakeCA().issue(CLIENT, T0).not_after)
    with pytest.raises(CaError, match="simulated CA failure"):
        await ca.fetch(Identity("error", "forgotten", "sa"))
    # A chain signed by another CA is described alike too.
    other = make_ca("elsewhere")
    assert await helper.describe([other.root_pem]) == await InProcess().describe([other.root_pem])


# --- the helper process ---------------------------------------------------------------------------------


async def test_requests_queued_at_once_share_one_helper(helper: CertHelper) -> None:
    certs = await asyncio.gather(*(helper.fake_issue(CLIENT, T0) for _ in range(20)))
    assert helper.started == 1
    serials = {c.chain_info[0]["serialNumber"] for c in certs}
    assert len(serials) == 20


async def test_the_helper_leaves_after_its_linger_and_comes_back(helper: CertHelper) -> None:
    await helper.describe(FakeCA().issue(CLIENT).roots_pem)
    pid = helper.pid
    assert pid is not None and not gone(pid)
    started = asyncio.get_running_loop().time()
    await eventually_async(lambda: gone(pid), "the helper to exit")
    assert asyncio.get_running_loop().time() - started >= 0.3  # not before its linger (0.5 s)
    assert helper.pid is None
    await helper.describe(FakeCA().issue(CLIENT).roots_pem)
    assert helper.started == 2 and helper.pid not in (None, pid)


async def test_requests_around_the_linger_are_all_answered() -> None:
    # With a linger of a few ms, a request often comes as the helper leaves: it goes to the next one.
    work = CertHelper(linger=0.01)
    try:
        roots = FakeCA().issue(CLIENT).roots_pem
        for i in range(25):
            assert len(await work.describe(roots)) == 1
            await asyncio.sleep(0.004 * (i % 5))  # gaps around the linger: the stimulus
        assert work.started >= 2
    finally:
        await work.close()


def unread_input(pid: int) -> int:
    """Bytes written to `pid`'s stdin and not read yet (what the kernel says the pipe holds)."""
    fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])
    finally:
        os.close(fd)


async def test_a_helper_killed_mid_request_fails_it_and_the_next_fetch_works(helper: CertHelper) -> None:
    ca = FakeCA(work=helper)
    await ca.fetch(CLIENT)
    pid = helper.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # it cannot answer: the request is surely in flight when it dies
    fetch = asyncio.create_task(ca.fetch(OTHER))
    await eventually_async(lambda: unread_input(pid) > 0, "the request in the stopped helper's pipe")
    assert not fetch.done()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(
        CaError, match=r"certificate helper process exited \(killed by SIGKILL\) before answering"
    ):
        await fetch
    cert = await ca.fetch(OTHER)
    assert cert.identity == OTHER and helper.started == 2


async def test_the_secret_manager_retries_after_a_helper_died(helper: CertHelper) -> None:
    now = [T0.timestamp()]
    manager = SecretManager(FakeCA(work=helper, clock=lambda: now[0]), clock=lambda: now[0])
    try:
        await helper.describe(FakeCA().issue(CLIENT).roots_pem)
        pid = helper.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        waiter = asyncio.create_task(manager.get(CLIENT))
        await eventually_async(lambda: unread_input(pid) > 0, "the request in the stopped helper's pipe")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(CertificateUnavailable, match="certificate helper process exited"):
            await waiter
        now[0] += 2  # past the first backoff
        assert await manager.refresh_due() == [CLIENT]
        [entry] = manager.dump()
        assert entry["state"] == "Available" and len(entry["certChain"]) == 1
        assert entry["certChain"] == list(await InProcess().describe((await manager.get(CLIENT)).chain_pem))
    finally:
        await manager.close()


async def test_the_helpers_stderr_goes_to_the_log(
    helper: CertHelper, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "ztunnel.identity.certhelper")
    # Not PEM: an unexpected failure of the operation, its traceback on the helper's stderr.
    with pytest.raises(CertWorkError, match="certificate operation describe failed: ValueError"):
        await helper.describe([b"garbage"])
    pid = helper.pid
    await eventually_async(
        lambda: any(f"certificate helper (pid {pid}): Traceback" in r.getMessage() for r in caplog.records),
        "the traceback in the log",
    )


async def test_a_closed_helper_refuses_and_leaves_no_process() -> None:
    work = CertHelper()
    await work.describe(FakeCA().issue(CLIENT).roots_pem)
    pid = work.pid
    assert pid is not None
    await work.close()
    assert gone(pid)
    with pytest.raises(CertWorkError, match="closed"):
        await work.describe([])


# --- the shipped proxy -----------------------------------------------------------------------------------


def maps_cryptography(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("/cryptography/" in line for line in f)


async def test_a_proxy_serves_hbone_and_its_parent_never_maps_cryptography(fleet: Fleet) -> None:
    """Two `ztunnel proxy` processes with the fake CA: HBONE between them as before; each parent had
    its certificate made by a helper process, which then left, and maps no cryptography file, even
    after `/config_dump` showed the certificate's details."""
    net = loopback_net()
    client_ip, server_ip = f"{net}.2", f"{net}.3"
    config = f"workloads:{workload_yaml('client', client_ip)}{workload_yaml('server', server_ip)}"
    echo = await start_echo(server_ip, 8080)
    try:
        client, server = await fleet.start(
            proxy_env(client_ip, "demo/client/client", config),
            proxy_env(server_ip, "demo/server/server", config),
        )
        payload = os.urandom(100_000)
        reply = await echo_roundtrip((client_ip, 15080), server_ip, 8080, payload)
        assert (reply.code, reply.digest) == (0, sha(payload))
        # Through the server's inbound: HBONE, mutual TLS with both certificates. (A scrape shows what
        # a worker that answers within its second reported: asked again until it did.)
        await eventually_async(
            lambda: server.metric("istio_tcp_connections_opened_total", reporter="destination") == 1,
            "the server's inbound connection counted",
            blocking=True,
        )
        for proxy in (client, server):
            parent = proxy.pid
            await eventually_async(lambda p=proxy: not p.cert_helpers(), "the certificate helper to leave")
            assert not maps_cryptography(parent)
            [entry] = (await asyncio.to_thread(proxy.config_dump))["certificates"]
            assert entry["state"] == "Available"
            [leaf] = entry["certChain"]
            pem = base64.b64decode(leaf["pem"])
            assert entry["certChain"] == list(await InProcess().describe([pem]))
            assert [r["pem"] for r in entry["rootCerts"]] == [base64.b64encode(FakeCA().root_pem).decode()]
            assert not maps_cryptography(parent)
            assert not any(maps_cryptography(pid) for pid in proxy.workers())  # nor do the workers
    finally:
        echo.server.close()


def test_the_control_sides_modules_import_no_cryptography() -> None:
    """What the parent imports to run its certificates and its CA client loads no cryptography."""
    code = (
        "import sys, ztunnel.control, ztunnel.identity.caclient, ztunnel.identity.certificates, ztunnel.workers.supervisor; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cryptography'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
