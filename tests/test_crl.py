"""`CRL_PATH` and the TLS settings as an operator meets them: start-up refusals in one line, the
file reloaded when it changes, a bad reload keeping the last good lists, the counters."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.certs import CA, issue, leaf, make_ca, make_crl
from tests.test_cli import dedicated, run
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


def test_compliance_policy_other_values_are_refused() -> None:
    line = _one_line_error({"COMPLIANCE_POLICY": "fips"})
    assert "invalid env var COMPLIANCE_POLICY=fips (expected pqc or empty)" in line


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
