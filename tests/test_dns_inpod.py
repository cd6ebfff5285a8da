"""In-pod DNS capture end to end (root): a pod's unmodified resolver (glibc's `getent`, `dig`) asks
some nameserver on port 53; the node agent's rules redirect it to the pod's DNS proxy, which answers
mesh names itself and forwards the rest from inside the pod's namespace to the nameserver of
ztunnel's own `/etc/resolv.conf` (a dnsmasq on the node, bind-mounted into ztunnel's private mount
namespace; the machine's own file is never touched).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cninode import Pod
from tests.harness import Proxy
from tests.inpod_mesh import Mesh, mesh_fixture, workload_yaml
from tests.netns import require_tools
from tests.waiting import eventually

__all__ = ["mesh_fixture"]  # the fixture, shared with the in-pod node tests

pytestmark = [pytest.mark.timeout(120), pytest.mark.root]

SERVICES = """services:
  - {name: echo, namespace: ns1, hostname: echo.ns1.svc.cluster.local, vips: ["/10.96.7.7"], ports: {80: 8080}}
  - {name: mesh-only, namespace: ns1, hostname: mesh-only.example, vips: ["/240.0.0.1"], ports: {80: 8080}}
"""
POD_RESOLV = (
    "nameserver 10.96.0.10\n"  # any address: the pod's DNS is captured
    "search ns1.svc.cluster.local svc.cluster.local cluster.local\n"
    "options ndots:5 timeout:2 attempts:2\n"
)


def in_pod(pod: Pod, resolv: Path, *cmd: str) -> subprocess.CompletedProcess[str]:
    """`cmd` in the pod with `resolv` as its /etc/resolv.conf (a private mount namespace)."""
    script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
    return pod.exec(
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        str(resolv),
        *cmd,
        check=False,
        timeout=30,
    )


@dataclass
class Captured:
    """A pod of ns1 whose DNS the node agent captures, its ztunnel, and the node's upstream."""

    zt: Proxy
    client: Pod
    resolv: Path  # the pod's resolv.conf (`POD_RESOLV`)
    upstream_log: Path

    def run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        return in_pod(self.client, self.resolv, *cmd)


@contextlib.contextmanager
def captured(mesh: Mesh, tmp_path: Path, config: Callable[[Pod], str], hosts: str) -> Iterator[Captured]:
    """A node agent and its ztunnel (its own resolv.conf naming a dnsmasq on the node that answers
    `hosts` and is authoritative for `upstream.test` and `cluster.local`), a client pod in ns1, and
    the mesh `config(client)`."""
    (dnsmasq,) = require_tools("dnsmasq", hint="Debian package dnsmasq-base")
    node = mesh.cluster.nodes[0]
    own_resolv = tmp_path / "ztunnel-resolv.conf"
    own_resolv.write_text(f"nameserver {node.gateway}\n")
    node.start_agent()
    # `ztunnel proxy` with its own /etc/resolv.conf bind-mounted in a private mount namespace.
    script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
    wrap = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(own_resolv)]
    zt = mesh.ztunnel(node, mesh.xds, wrap=wrap, LOG_LEVEL="info,dns=debug")
    del zt.env["ZTUNNEL_WORKER_THREADS"]  # the default count
    zt.start()

    client = node.add_pod("client", namespace="ns1", service_account="client")
    assert "--dport 53 -j REDIRECT --to-ports 15053" in client.iptables_save()
    mesh.push(config(client))
    mesh.wait_for_workloads(zt, [client])

    # The upstream: dnsmasq on the node's bridge address (it exists once a pod is attached).
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts)
    up_log = tmp_path / "dnsmasq.log"
    upstream = subprocess.Popen(
        ["ip", "netns", "exec", node.ns.name, dnsmasq, "--keep-in-foreground", "--no-resolv", "--no-hosts",
         f"--addn-hosts={hosts_file}", "--bind-interfaces", f"--listen-address={node.gateway}", "--port=53",
         "--local=/upstream.test/", "--local=/cluster.local/", "--log-queries", "--log-facility=-",
         "--user=root", f"--pid-file={tmp_path / 'dnsmasq.pid'}"],
        stdout=up_log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        eventually(lambda: "started" in up_log.read_text(), "dnsmasq start")
        pod_resolv = tmp_path / "pod-resolv.conf"
        pod_resolv.write_text(POD_RESOLV)
        yield Captured(zt, client, pod_resolv, up_log)
    finally:
        upstream.terminate()
        upstream.wait(10)


def test_pod_dns_is_captured_and_answered_or_forwarded(mesh: Mesh, tmp_path: Path) -> None:
    (dig,) = require_tools("dig", hint="Debian package bind9-dnsutils")
    with captured(
        mesh,
        tmp_path,
        lambda client: "workloads:\n" + workload_yaml(client) + SERVICES,
        "192.0.2.7 known.upstream.test\n",
    ) as pod:
        client, zt = pod.client, pod.zt
        for name, want in [
            ("echo.ns1.svc.cluster.local", "10.96.7.7"),
            ("echo", "10.96.7.7"),
            ("mesh-only.example", "240.0.0.1"),
            ("known.upstream.test", "192.0.2.7"),
        ]:
            done = pod.run("getent", "hosts", name)
            assert done.returncode == 0 and done.stdout.split()[0] == want, (name, done.stdout, done.stderr)
        # Forwarded from the pod's namespace: the upstream saw the pod's address.
        assert f"query[A] known.upstream.test from {client.ip}" in pod.upstream_log.read_text()

        # TCP is captured too; an unknown name gets the upstream's NXDOMAIN.
        done = pod.run(dig, "+tcp", "+short", "@10.96.0.10", "echo.ns1.svc.cluster.local")
        assert done.stdout.strip() == "10.96.7.7", done.stdout + done.stderr
        done = pod.run(dig, "+tcp", "@10.96.0.10", "nothere.upstream.test")
        assert "status: NXDOMAIN" in done.stdout, done.stdout
        # Each query logged at debug under the `dns` target (the reference's fields), the pod as client.
        out = zt.log()
        assert (
            'src.workload="client" src.namespace="ns1" query="a" domain="echo.ns1.svc.cluster.local" result="success" endpoints=[10.96.7.7]'
            in out
        )
        assert 'domain="known.upstream.test" result="forwarded"' in out
        metrics = zt.metrics_text()
        assert 'istio_dns_requests_total{request_query_type="a",request_protocol="tcp"' in metrics
        assert 'istio_dns_upstream_requests_total{request_query_type="a",request_protocol="udp"' in metrics
