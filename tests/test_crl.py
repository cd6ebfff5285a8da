"""`CRL_PATH` and the TLS settings as an operator meets them: start-up refusals in one line, a
compliance policy taken with a warning, the file reloaded when it changes, a bad reload keeping the
last good lists, the counters."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.apps import echo_roundtrip, loopback_net, sha, start_echo, workload_yaml
from tests.certs import CA, issue, leaf, make_ca, make_crl
from tests.harness import Fleet, proxy_env
from tests.test_cli import dedicated, run
from tests.waiting import eventually_async
from ztunnel.identity.crl import CrlError, CrlWatcher
from ztunnel.metrics.families import Metrics


@pytest.fixture(scope="module")
def ca() -> CA:
    return make_ca()


def _one_line_error(env: dict[str, str]) -> str:
    r = run(["proxy"], dedicated("127.0.0.1", **env))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def test_unreadable_crl_file_stops_start_up_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    line = _one_line_error({"CRL_PATH": str(missing)})
    assert f"CRL_PATH={missing}: cannot read the CRL file: No such file or directory" in line


def test_invalid_crl_file_stops_start_up_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "crl.pem"
    bad.write_bytes(b"-----BEGIN X509 CRL-----\nnot base64 at all\n-----END X509 CRL-----\n")
    line = _one_line_error({"CRL_PATH": str(bad)})
    assert f"CRL_PATH={bad}: invalid CRL file: CRL 1 does not parse" in line


def test_compliance_policy_pqc_is_refused_in_one_line_naming_the_missing_api() -> None:
    from importlib.metadata import version

    from cryptography.hazmat.backends.openssl import backend

    line = _one_line_error({"COMPLIANCE_POLICY": "pqc"})
    assert "invalid env var COMPLIANCE_POLICY=pqc (not supported:" in line
    assert "X25519MLKEM768" in line
    # The engine that has the group, and what it lacks to select it alone.
    assert f"pyOpenSSL {version('pyopenssl')} on {backend.openssl_version_text()}" in line
    assert "has no SSL.Context.set_groups (SSL_CTX_set1_groups_list)" in line


async def test_compliance_policy_fips_140_3_starts_serves_and_warns_once(fleet: Fleet) -> None:
    """Istio's mesh-wide `fips-140-3` reaches the proxy: it starts, carries HBONE, says the policy
    is not enforced in one warning, and shows it in /config_dump."""
    net = loopback_net()
    server, frontend = f"{net}.3", f"{net}.2"
    config = f"workloads:{workload_yaml('server', server)}{workload_yaml('frontend', frontend)}"
    policy = {"COMPLIANCE_POLICY": "fips-140-3"}
    echo = await start_echo(server, 8080)
    try:
        proxies = await fleet.start(
            proxy_env(server, "demo/server/server", config, **policy),
            proxy_env(frontend, "demo/frontend/frontend", config, **policy),
        )
        ex = await echo_roundtrip((frontend, 15080), server, 8080, b"over HBONE")
        assert (ex.code, ex.digest) == (0, sha(b"over HBONE"))
        warning = '\twarn\tconfig\t"COMPLIANCE_POLICY=fips-140-3 is not enforced: '
        for proxy in proxies:
            await eventually_async(lambda p=proxy: warning in p.log(), "the warning", 10.0, blocking=True)
            lines = [line for line in proxy.log().splitlines() if "COMPLIANCE_POLICY" in line]
            assert len(lines) == 1 and warning in lines[0], lines
            assert proxy.config_dump()["config"]["compliancePolicy"] == "fips-140-3"
    finally:
        echo.server.close()


def test_reload_on_change_and_a_bad_reload_keeps_the_last_good_list(
    ca: CA, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "crl.pem"
    revoked = issue(ca, "spiffe://cluster.local/ns/a/sa/revoked")
    path.write_bytes(make_crl(ca))
    metrics = Metrics(process_metrics=False)
    watcher = CrlWatcher.load(str(path), metrics)
    chain = [leaf(revoked), ca.cert]
    assert watcher.revocation.revoked(chain) is None
    assert watcher.check() is False  # unchanged

    path.write_bytes(make_crl(ca, [revoked]))
    assert watcher.check() is True
    assert watcher.revocation.revoked(chain) is not None

    caplog.set_level(logging.WARNING, logger="ztunnel.identity.crl")
    path.write_bytes(b"garbage")
    assert watcher.check() is False
    assert watcher.revocation.revoked(chain) is not None  # the last good list stays
    [record] = [r for r in caplog.records if r.name == "ztunnel.identity.crl"]
    assert "CRL reload failed, keeping the last good list" in record.getMessage()
    assert "no PEM CRL" in record.getMessage()

    os.unlink(path)
    assert watcher.check() is False
    assert "cannot read the CRL file" in caplog.records[-1].getMessage()

    path.write_bytes(make_crl(ca))  # back to revoking nothing
    assert watcher.check() is True
    assert watcher.revocation.revoked(chain) is None

    body = metrics.render(None)[0].decode()
    assert "istio_crl_policy_rejections_total 0\n" in body
    assert "istio_crl_untracked_connections_total 0\n" in body


def test_load_raises_one_line(tmp_path: Path) -> None:
    path = tmp_path / "crl.pem"
    path.write_bytes(b"")
    with pytest.raises(CrlError, match=r"^CRL_PATH=.*: invalid CRL file: no PEM CRL"):
        CrlWatcher.load(str(path))
