"""Every setting the proxy accepts takes effect and is documented.

Two guards over the whole tree (a field of `Config` that nothing outside the modules building it reads is a
setting that is accepted and shown in `/config_dump` but does nothing; one missing from
`docs/configuration.md` is one an operator cannot look up), and the observable effect of the
settings that only change what the proxy does at run time (`ENABLE_PROXY`,
`AUTHZ_POLICY_INFO_LOGGING`)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.apps import ONLY_FRONTEND, echo_roundtrip, loopback_net, start_echo, workload_yaml
from tests.harness import Fleet, Proxy, proxy_env
from tests.waiting import eventually_async
from ztunnel.config.settings import Config

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ztunnel", "hbone", "xds", "mesh", "policy", "cni", "controlplane", "benches")
CONFIGURATION_DOC = ROOT / "docs" / "configuration.md"
# The modules that read the environment into a `Config`: the setting is used elsewhere or not at all.
CONFIG_MODULES = (
    "ztunnel/config/settings.py",
    "ztunnel/config/envvars.py",
    "ztunnel/config/proxyconfig.py",
    "ztunnel/config/workercount.py",
)


def _sources() -> str:
    texts = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in CONFIG_MODULES or rel.startswith("xds/gen/"):
                continue
            texts.append(path.read_text(encoding="utf-8"))
    return "\n".join(texts)


def test_every_config_field_is_read_outside_config_py() -> None:
    sources = _sources()
    # Read through a configuration object (`cfg.x`, `config.x`, `self._config.x`), not any `.x`.
    unread = {
        f.name
        for f in dataclasses.fields(Config)
        if not re.search(rf"\b(?:cfg|config|_config)\.{f.name}\b", sources)
    }
    assert not unread, f"settings accepted but never used: {sorted(unread)}"


def test_every_config_field_and_variable_is_documented() -> None:
    doc = CONFIGURATION_DOC.read_text(encoding="utf-8")
    dumped = Config().to_dump()
    # Every field but the inline local config is in /config_dump; the doc names each by that key.
    assert {f.name for f in dataclasses.fields(Config)} - {
        re.sub(r"[A-Z]", lambda m: "_" + m.group(0).lower(), k) for k in dumped
    } == {"local_xds"}
    missing_keys = sorted(k for k in dumped if f"`{k}`" not in doc)
    assert not missing_keys, f"Config fields missing from docs/configuration.md: {missing_keys}"
    # And every environment variable the parser reads, by name.
    source = "\n".join((ROOT / rel).read_text(encoding="utf-8") for rel in CONFIG_MODULES)
    variables = set(re.findall(r'"([A-Z][A-Z0-9_]{2,})"', source))
    assert "SECRET_TTL" in variables and "XDS_HEADER_" in variables  # the scan finds them at all
    missing = sorted(v for v in variables if f"`{v}" not in doc)
    assert not missing, f"variables missing from docs/configuration.md: {missing}"


# --- run-time effects --------------------------------------------------------------------------

NET = loopback_net()
SERVER, FRONTEND, INTRUDER = f"{NET}.3", f"{NET}.2", f"{NET}.4"

CONFIG = f"""
workloads:{workload_yaml("server", SERVER)}{workload_yaml("frontend", FRONTEND)}{workload_yaml("intruder", INTRUDER)}{ONLY_FRONTEND}"""


async def test_enable_proxy_false_binds_no_proxy_listener(fleet: Fleet) -> None:
    env = proxy_env(
        SERVER,
        "demo/server/server",
        CONFIG,
        ENABLE_PROXY="false",
        ISTIO_META_DNS_PROXY_ADDR=f"{SERVER}:15053",
    )
    [proxy] = await fleet.start(env)  # ready: /healthz/ready answered 200
    for port in (15001, 15006, 15008, 15080):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((SERVER, port), timeout=5).close()
    # Only the DNS proxy runs (its TCP side accepts).
    await asyncio.to_thread(lambda: socket.create_connection((SERVER, 15053), timeout=5).close())
    assert proxy.config_dump()["config"]["enableProxy"] is False


class Logs:
    """What the proxies logged, at the default level (info), plain format."""

    def __init__(self, proxies: list[Proxy]) -> None:
        self.proxies = proxies

    def getvalue(self) -> str:
        return "".join(proxy.log() for proxy in self.proxies)


@pytest.fixture
async def mesh(request: pytest.FixtureRequest, fleet: Fleet) -> AsyncIterator[Logs]:
    echo = await start_echo(SERVER, 8080)
    try:
        extra = {"AUTHZ_POLICY_INFO_LOGGING": request.param}
        proxies = await fleet.start(
            proxy_env(SERVER, "demo/server/server", CONFIG, **extra),
            *(
                proxy_env(ip, f"demo/{name}/{name}", CONFIG)
                for name, ip in (("frontend", FRONTEND), ("intruder", INTRUDER))
            ),
        )
        yield Logs(proxies)
    finally:
        echo.server.close()


DENIED_LINE = (
    f'info\trbac\t"connection denied by policy"\tsrc.addr={INTRUDER}:'
    # the rest of the line: the port, dst.addr and the reason
)


@pytest.mark.parametrize("mesh", ["true"], indirect=True)
async def test_policy_verdicts_at_info_with_authz_policy_info_logging(mesh: Logs) -> None:
    assert (await echo_roundtrip((INTRUDER, 15080), SERVER, 8080, b"x")).code == 2
    assert (await echo_roundtrip((FRONTEND, 15080), SERVER, 8080, b"x")).code == 0
    await eventually_async(lambda: DENIED_LINE in mesh.getvalue(), "the denial at info")
    denied = next(line for line in mesh.getvalue().splitlines() if DENIED_LINE in line)
    assert denied.endswith(
        'reason="connection closed due to policy rejection: allow policies exist, but none allowed"'
    )
    # Each process's writer thread writes its lines a few ms later: waited for, as the denial.
    allowed = f'info\trbac\t"connection allowed by policy"\tsrc.addr={FRONTEND}:'
    await eventually_async(lambda: allowed in mesh.getvalue(), "the allowed verdict at info")


@pytest.mark.parametrize("mesh", ["false"], indirect=True)
async def test_policy_verdicts_stay_at_debug_by_default(mesh: Logs) -> None:
    assert (await echo_roundtrip((INTRUDER, 15080), SERVER, 8080, b"x")).code == 2
    # The server's access log of the denial comes after the verdict: once it is there, the verdict
    # would have been logged too.
    await eventually_async(
        lambda: "connection closed due to policy rejection" in mesh.getvalue(), "the denial's access log"
    )
    assert "rbac" not in mesh.getvalue()
