"""A container runtime for tests (root only): nodes made of network namespaces, pods made by real CNI plugins.

A `Node` is a network namespace with IP forwarding on, a pod subnet 10.88.<index>.0/24 on a bridge
(`mesh0`, the gateway 10.88.<index>.1), and a working directory holding its agent's sockets, state
file, log and host-local IPAM data. `node.start_agent()` runs `ztunnel cni-agent` inside the node
namespace. `node.add_pod(...)` does what a container runtime does for a pod sandbox: it creates the
pod's namespace, then runs the network configuration list

    bridge (isGateway, host-local IPAM)  →  ztunnel-cni (agentSocket = the node's CNI socket)

inside the node namespace, exactly as libcni invokes plugins: `CNI_*` in the environment, each plugin's
configuration on stdin with `name` and `cniVersion` injected and the previous plugin's result as
`prevResult`; DEL runs the list in reverse with the ADD's result as `prevResult`. `join(a, b)` wires two
nodes with a veth and routes to each other's pod subnets.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness import NodeAgent
from tests.netns import Netns, link

CNI_BIN_DIR = Path("/usr/lib/cni")
VENV_BIN = Path(sys.executable).parent
ZTUNNEL = VENV_BIN / "ztunnel"
ZTUNNEL_CNI = VENV_BIN / "ztunnel-cni"
CNI_VERSION = "1.0.0"
NETWORK_NAME = "mesh"
BRIDGE = "mesh0"

_indexes = itertools.count(1)
_links = itertools.count(1)


@dataclass
class CniResult:
    """One plugin run: exit status and stdout (a result or a CNI error object), as the runtime sees it."""

    plugin: str
    command: str
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def output(self) -> dict[str, Any] | None:
        try:
            value = json.loads(self.stdout) if self.stdout.strip() else None
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, dict) else None

    @property
    def error(self) -> dict[str, Any]:
        """The CNI error object (`code`, `msg`, `details`) of a failed run."""
        assert not self.ok, f"{self.plugin} {self.command} succeeded"
        assert self.output is not None, f"{self.plugin} {self.command} failed without an error object: {self}"
        return self.output

    def __str__(self) -> str:
        return f"{self.plugin} {self.command}: exit {self.returncode}, stdout {self.stdout!r}, stderr {self.stderr!r}"


class CniFailure(AssertionError):
    def __init__(self, result: CniResult) -> None:
        super().__init__(str(result))
        self.result = result


@dataclass
class Pod:
    node: Node
    name: str
    namespace: str
    service_account: str
    uid: str
    container_id: str
    enrolled: bool
    netns: Netns
    result: dict[str, Any] | None = None  # the ADD's final result, cached for DEL like a runtime does
    ip: str = ""

    @property
    def netns_path(self) -> str:
        return f"/var/run/netns/{self.netns.name}"

    @property
    def cni_args(self) -> str:
        args = [
            "IgnoreUnknown=1",
            f"K8S_POD_NAMESPACE={self.namespace}",
            f"K8S_POD_NAME={self.name}",
            f"K8S_POD_INFRA_CONTAINER_ID={self.container_id}",
            f"K8S_POD_UID={self.uid}",
            f"K8S_POD_SERVICE_ACCOUNT={self.service_account}",
        ]
        if not self.enrolled:
            args.append("ISTIO_AMBIENT=disabled")
        return ";".join(args)

    def exec(self, *args: str, check: bool = True, timeout: float = 15) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.netns.name, *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    def popen(self, args: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
        return self.netns.popen(args, dict(os.environ), str(log_path))

    def iptables_save(self) -> str:
        """`iptables-save` inside the pod (all tables: our chains are in nat and mangle)."""
        return self.exec("iptables-save").stdout


class Node:
    def __init__(self, workdir: Path, index: int | None = None) -> None:
        self.index = next(_indexes) if index is None else index
        self.subnet = f"10.88.{self.index}.0/24"
        self.gateway = f"10.88.{self.index}.1"
        self.dir = workdir / f"node{self.index}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.zds_socket = self.dir / "ztunnel.sock"
        self.cni_socket = self.dir / "cni-agent.sock"
        self.state_file = self.dir / "pods.json"
        self.agent_log = self.dir / "agent.log"
        self.agent: NodeAgent | None = None
        self.agent_args: list[str] = []
        self.pods: list[Pod] = []
        self.ns = Netns(f"node{self.index}")
        self.ns.exec("sysctl", "-qw", "net.ipv4.ip_forward=1")

    # -- the agent --------------------------------------------------------------------------------

    def start_agent(
        self,
        *extra_args: str,
        zds_socket: Path | None = None,
        cni_socket: Path | None = None,
        timeout: float = 10,
    ) -> NodeAgent:
        """Run `ztunnel cni-agent` in the node namespace; return once its CNI socket accepts connections."""
        assert self.agent is None or not self.agent.running(), "agent already running"
        self.zds_socket = zds_socket or self.zds_socket
        self.cni_socket = cni_socket or self.cni_socket
        self.agent_args = list(extra_args)
        args = ["--state-file", str(self.state_file), *extra_args]
        self.agent = NodeAgent(
            self.agent_log, self.zds_socket, self.cni_socket, args, {"LOG_LEVEL": "debug"}, netns=self.ns.name
        )
        with self.agent_log.open("ab") as log:
            log.write(f"--- {' '.join(self.agent.args)}\n".encode())
        self.agent.start(timeout)
        return self.agent

    def stop_agent(self, sig: int = signal.SIGTERM) -> int:
        """Stop the agent (SIGTERM: a clean exit); its exit status."""
        assert self.agent is not None and self.agent.process is not None, "agent not running"
        agent, self.agent = self.agent, None
        agent.send(sig)
        try:
            code = agent.wait_exit(10)
        except subprocess.TimeoutExpired:
            agent.kill()
            code = agent.wait_exit()
        agent.kill()  # whatever of its group is left
        return code

    def restart_agent(self) -> NodeAgent:
        self.stop_agent()
        return self.start_agent(*self.agent_args)

    def agent_output(self) -> str:
        """What the agent logged so far (all runs)."""
        return self.agent_log.read_text(errors="replace") if self.agent_log.exists() else ""

    # -- pods, through the CNI plugins -----------------------------------------------------------

    def plugins(self, agent_socket: Path | None = None) -> list[dict[str, Any]]:
        """The network configuration list's plugins."""
        return [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "subnet": self.subnet,
                    "gateway": self.gateway,
                    "routes": [{"dst": "0.0.0.0/0"}],  # the default route, via the gateway
                    "dataDir": str(self.dir / "ipam"),
                },
            },
            {"type": "ztunnel-cni", "agentSocket": str(agent_socket or self.cni_socket)},
        ]

    def run_plugin(
        self, plugin: dict[str, Any], command: str, pod: Pod, prev_result: dict[str, Any] | None
    ) -> CniResult:
        """Run one plugin of the list for `pod`, in the node namespace, as libcni does."""
        conf = {**plugin, "name": NETWORK_NAME, "cniVersion": CNI_VERSION}
        if prev_result is not None:
            conf["prevResult"] = prev_result
        binary = ZTUNNEL_CNI if plugin["type"] == "ztunnel-cni" else CNI_BIN_DIR / plugin["type"]
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": pod.container_id,
            "CNI_NETNS": pod.netns_path,
            "CNI_IFNAME": "eth0",
            "CNI_PATH": str(CNI_BIN_DIR),
            "CNI_ARGS": pod.cni_args,
        }
        done = subprocess.run(
            ["ip", "netns", "exec", self.ns.name, str(binary)],
            input=json.dumps(conf),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return CniResult(plugin["type"], command, done.returncode, done.stdout, done.stderr)

    def new_pod(
        self,
        name: str,
        namespace: str = "default",
        service_account: str = "default",
        enrolled: bool = True,
        uid: str | None = None,
    ) -> Pod:
        """A pod sandbox: its namespace only, no network yet."""
        pod = Pod(
            node=self,
            name=name,
            namespace=namespace,
            service_account=service_account,
            uid=uid or f"uid-{name}-{uuid.uuid4().hex[:8]}",
            container_id=uuid.uuid4().hex,
            enrolled=enrolled,
            netns=Netns(f"pod-{name}"[:12]),
        )
        self.pods.append(pod)
        return pod

    def cni_add(self, pod: Pod, agent_socket: Path | None = None) -> CniResult:
        """ADD through the whole list; the first failure, else the last plugin's result."""
        prev: dict[str, Any] | None = None
        for plugin in self.plugins(agent_socket):
            result = self.run_plugin(plugin, "ADD", pod, prev)
            if not result.ok:
                return result
            prev = result.output
            if plugin["type"] == "bridge" and prev is not None:
                pod.ip = str(prev["ips"][0]["address"]).split("/")[0]
        pod.result = prev
        return result

    def cni_del(self, pod: Pod, agent_socket: Path | None = None) -> list[CniResult]:
        """DEL through the list in reverse, with the cached ADD result as prevResult."""
        return [self.run_plugin(p, "DEL", pod, pod.result) for p in reversed(self.plugins(agent_socket))]

    def cni_check(self, pod: Pod) -> CniResult:
        """CHECK through the list; the first failure, else the last plugin's."""
        for plugin in self.plugins():
            result = self.run_plugin(plugin, "CHECK", pod, pod.result)
            if not result.ok:
                return result
        return result

    def ztunnel_cni(self, command: str, pod: Pod) -> CniResult:
        """Run ztunnel-cni alone, with the pod's cached result as prevResult (a re-ADD, a CHECK, ...)."""
        return self.run_plugin(self.plugins()[-1], command, pod, pod.result)

    def try_add_pod(
        self,
        name: str,
        namespace: str = "default",
        service_account: str = "default",
        enrolled: bool = True,
        uid: str | None = None,
    ) -> tuple[CniResult, Pod]:
        """ADD a new pod; the pod is returned also when ADD failed (its namespace left for inspection)."""
        pod = self.new_pod(name, namespace, service_account, enrolled, uid)
        return self.cni_add(pod), pod

    def add_pod(
        self,
        name: str,
        namespace: str = "default",
        service_account: str = "default",
        enrolled: bool = True,
        uid: str | None = None,
    ) -> Pod:
        """ADD a new pod, or raise CniFailure after cleaning up as a runtime does (DEL, namespace gone)."""
        result, pod = self.try_add_pod(name, namespace, service_account, enrolled, uid)
        if not result.ok:
            self.del_pod(pod)
            raise CniFailure(result)
        return pod

    def del_pod(self, pod: Pod) -> list[CniResult]:
        """DEL the pod's network (reverse order) and remove its namespace."""
        results = self.cni_del(pod)
        pod.netns.delete()
        if pod in self.pods:
            self.pods.remove(pod)
        return results

    def close(self) -> None:
        if self.agent is not None:
            self.stop_agent()
        for pod in self.pods:
            pod.netns.delete()
        self.pods.clear()
        self.ns.delete()


def join(a: Node, b: Node) -> tuple[str, str]:
    """A veth between two nodes, and routes to each other's pod subnets; the two link addresses."""
    n = next(_links)
    a_ip, b_ip = f"10.87.{n}.1", f"10.87.{n}.2"
    link(a.ns, a_ip, b.ns, b_ip)
    a.ns.exec("ip", "route", "add", b.subnet, "via", b_ip)
    b.ns.exec("ip", "route", "add", a.subnet, "via", a_ip)
    return a_ip, b_ip


@dataclass
class Cluster:
    """Nodes made for one test, all closed at the end."""

    workdir: Path
    nodes: list[Node] = field(default_factory=list)

    def node(self) -> Node:
        node = Node(self.workdir)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.close()
