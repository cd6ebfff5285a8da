"""The process harness itself (tests/harness.py): a `ztunnel proxy` started as deployed is a
supervisor and two workers in one process group (with, for 2 s after its start-up certificate, the
certificate helper); it drains on /quitquitquit
and on SIGTERM, comes back on a restart, and nothing of it outlives the fleet, even when its
supervisor was killed outright."""

from __future__ import annotations

import asyncio
import signal

from tests.apps import loopback_net, workload_yaml
from tests.harness import Fleet, proxy_env
from tests.procs import group_members
from tests.waiting import eventually_async

NET = loopback_net()
IP = f"{NET}.2"
CONFIG = f"workloads:{workload_yaml('one', IP, uid='h//v1/Pod')}\n"


async def test_drain_restart_and_no_orphans(fleet: Fleet) -> None:
    [proxy] = await fleet.start(proxy_env(IP, "demo/one/one", CONFIG))
    await eventually_async(lambda: len(proxy.pids()) == 3, "the supervisor and two workers, the helper gone")
    first = proxy.pids()
    assert set(proxy.listeners()) >= {"inbound", "outbound", "socks5"}
    assert proxy.listeners()["socks5"] == proxy.socks5
    assert "workers" in proxy.config_dump()
    assert proxy.metric("istio_build", component="ztunnel") == 1

    assert await asyncio.to_thread(proxy.quit) == 0  # an operator's drain
    assert "shutting down" in proxy.log()
    await asyncio.to_thread(proxy.kill)
    assert group_members(first[0]) == []

    await proxy.astart()  # the same settings again
    assert proxy.starts == 2
    await eventually_async(lambda: len(proxy.pids()) == 3, "the supervisor and two workers again")
    assert await proxy.aterminate() == 0  # SIGTERM: the same drain

    await proxy.astart()
    leader = proxy.pids()[0]
    assert proxy.process is not None and leader == proxy.process.pid
    proxy.process.send_signal(signal.SIGKILL)  # the supervisor dies; its workers must not linger
    await asyncio.to_thread(proxy.process.wait)
    # They notice on their own (the shipped processes watch their parent) ...
    await eventually_async(lambda: group_members(leader) == [], "the workers to follow the supervisor")
    fleet.close()  # ... and the fleet would kill them anyway
    assert group_members(leader) == []
