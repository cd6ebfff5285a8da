"""The listen plan (which sockets a proxy of a configuration binds) and the one proxy factory: it binds
exactly that plan, a conflict leaves nothing bound, and the rules are fixed before serving."""

from __future__ import annotations

import errno
import os
import random
import socket
from dataclasses import replace

import pytest

from ztunnel.config.settings import Config, WorkloadInfo
from ztunnel.identity.certificates import FakeCA, SecretManager
from ztunnel.metrics.families import Metrics
from ztunnel.proxy.instance import ProxyInputs, build_proxy
from ztunnel.proxy.plan import ListenSpec, listen_plan
from ztunnel.sockets import SocketFactory
from ztunnel.state.store import ProxyState

INFO = WorkloadInfo(namespace="ns", name="client", service_account="client")
BIND = "127.0.0.9"
DEDICATED = Config(proxy_mode="dedicated", workload_info=INFO, proxy_bind_address=BIND)


@pytest.mark.parametrize(
    ("config", "inbound_only", "plan"),
    [
        (
            DEDICATED,
            False,
            [
                ("outbound", BIND, 15001, True),
                ("inbound_plaintext", BIND, 15006, True),
                ("inbound", BIND, 15008, True),
                ("dns", BIND, 15053, False),  # a dedicated proxy's DNS follows PROXY_BIND_ADDRESS
            ],
        ),
        (
            replace(DEDICATED, enable_orig_src=False, dns_capture=False, enable_socks5=True),
            False,
            [
                ("outbound", BIND, 15001, False),
                ("inbound_plaintext", BIND, 15006, False),
                ("inbound", BIND, 15008, False),
                ("socks5", "127.0.0.1", 15080, False),
            ],
        ),
        # In-pod: a pod's proxy binds the wildcard in the pod's namespace, whatever PROXY_BIND_ADDRESS.
        (
            Config(proxy_bind_address=BIND),
            False,
            [
                ("outbound", "", 15001, True),
                ("inbound_plaintext", "", 15006, True),
                ("inbound", "", 15008, True),
                ("dns", "127.0.0.1", 15053, False),
            ],
        ),
        (Config(), True, [("inbound", "", 15008, False)]),  # ztunnel's own: never transparent
        (replace(DEDICATED, enable_proxy=False), False, [("dns", BIND, 15053, False)]),
        (replace(DEDICATED, enable_proxy=False), True, []),
    ],
)
def test_listen_plan(config: Config, inbound_only: bool, plan: list[tuple[str, str, int, bool]]) -> None:
    assert listen_plan(config, inbound_only=inbound_only) == tuple(ListenSpec(*spec) for spec in plan)


def _address() -> str:
    """A loopback address of this test's own: the proxy's fixed ports collide with no one's."""
    return f"127.{os.getpid() % 200 + 20}.{random.randrange(1, 255)}.{random.randrange(1, 255)}"


def _inputs(config: Config) -> ProxyInputs:
    return ProxyInputs(config, ProxyState(), SecretManager(FakeCA()), Metrics(process_metrics=False))


async def test_the_factory_binds_the_plan_and_drains_unserved() -> None:
    bind = _address()
    config = replace(DEDICATED, proxy_bind_address=bind, enable_socks5=True, socks5_address=(bind, 15080))
    proxy = build_proxy(_inputs(config), INFO, SocketFactory())
    try:
        assert proxy.addresses == {s.name: (s.host, s.port) for s in listen_plan(config)}
        assert proxy.ctx.rules.spoof_source is False  # a dedicated proxy's default
        with pytest.raises(OSError):
            socket.create_server((bind, 15001))
    finally:
        await proxy.drain(0, graceful=False)
    socket.create_server((bind, 15001)).close()  # a drain closes what was never served


async def test_a_conflict_is_an_oserror_and_leaves_nothing_bound() -> None:
    bind = _address()
    config = replace(DEDICATED, proxy_bind_address=bind)
    taken = socket.create_server((bind, 15008))
    try:
        with pytest.raises(OSError) as raised:
            build_proxy(_inputs(config), INFO, SocketFactory())
        assert raised.value.errno == errno.EADDRINUSE
        # The listeners bound before the conflict were closed again.
        for port in (15001, 15006):
            socket.create_server((bind, port)).close()
    finally:
        taken.close()
