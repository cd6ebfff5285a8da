"""The node agent puts `ztunnel-cni` on the node, as istio-cni does: the plugin copied into the CNI bin
directory, chained into the primary (lexically first) network configuration, chained again when the
primary CNI rewrites it, and removed by `ztunnel cni-agent --uninstall`.

The root test is a node made of a network namespace (tests/cninode.py) whose runtime reads the conf
directory as libcni does and runs the chained list through Debian's `bridge` and `host-local` and the
installed `ztunnel-cni`, with a pod namespace; a shared-mode ztunnel takes the pod.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cni.install import ChainKeeper, InstallConfig, chained, install_plugin, primary_conf, uninstall
from tests.cninode import CNI_BIN_DIR, Node, Pod
from tests.harness import Fleet
from tests.netns import require_root, require_tools
from tests.waiting import eventually

ZTUNNEL = str(Path(sys.executable).parent / "ztunnel")
SOCKET = "/var/run/ztunnel/cni-agent.sock"


def bridge_conflist(data_dir: Path, subnet: str = "10.88.0.0/24") -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "mesh0",
                "isGateway": True,
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "subnet": subnet,
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(data_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=4) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict)
    return doc


def plugin_types(path: Path) -> list[str]:
    return [p["type"] for p in read_json(path)["plugins"]]


# --- without root: the files ---------------------------------------------------------------------


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir, conf_dir = tmp_path / "bin", tmp_path / "net.d"
    conf_dir.mkdir()
    return bin_dir, conf_dir


def test_install_chains_into_the_lexically_first_and_uninstall_restores(dirs: tuple[Path, Path]) -> None:
    bin_dir, conf_dir = dirs
    primary, other = conf_dir / "10-bridge.conflist", conf_dir / "20-other.conflist"
    original = bridge_conflist(Path("/tmp/ipam"))
    write_json(primary, original)
    write_json(other, bridge_conflist(Path("/tmp/other")))
    (conf_dir / "README").write_text("not a configuration\n")
    config = InstallConfig(bin_dir, conf_dir, SOCKET)

    plugin = install_plugin(config)
    assert ChainKeeper(config).ensure() is True

    assert plugin == bin_dir / "ztunnel-cni" and os.access(plugin, os.X_OK)
    assert read_json(primary)["plugins"][-1] == {"type": "ztunnel-cni", "agentSocket": SOCKET}
    assert plugin_types(primary) == ["bridge", "portmap", "ztunnel-cni"]
    assert plugin_types(other) == ["bridge", "portmap"]

    changed = uninstall(config)
    assert read_json(primary) == original
    assert plugin_types(other) == ["bridge", "portmap"]
    assert not plugin.exists()
    assert set(changed) == {primary, plugin}


def test_the_copied_plugin_runs_on_its_own(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """What lands in the bin directory is a standalone executable, not a script of the agent's venv."""
    bin_dir, conf_dir = dirs
    plugin = install_plugin(InstallConfig(bin_dir, conf_dir, SOCKET))
    clean_env = {"PATH": "/usr/bin:/bin", "CNI_COMMAND": "VERSION"}
    done = subprocess.run(
        [str(plugin)], input=b"{}", env=clean_env, cwd=tmp_path, capture_output=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "1.0.0" in json.loads(done.stdout)["supportedVersions"]


def test_the_plugin_refuses_an_exclusion_list_that_is_not_one(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    bin_dir, conf_dir = dirs
    plugin = install_plugin(InstallConfig(bin_dir, conf_dir, SOCKET, interpreter=sys.executable))
    assert plugin.read_bytes().startswith(f"#!{sys.executable}\n".encode())
    conf = {"cniVersion": "1.0.0", "name": "k8s", "type": "ztunnel-cni", "excludeNamespaces": "kube-system"}
    env = {
        "PATH": "/usr/bin:/bin",
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": "/x",
        "CNI_IFNAME": "eth0",
    }
    done = subprocess.run(
        [str(plugin)], input=json.dumps(conf).encode(), env=env, capture_output=True, timeout=30, check=False
    )
    assert done.returncode == 1
    error = json.loads(done.stdout)
    assert error["msg"] == "network configuration: excludeNamespaces must be a list of strings"


def test_a_rewrite_is_chained_again_and_a_new_primary_takes_the_plugin(dirs: tuple[Path, Path]) -> None:
    bin_dir, conf_dir = dirs
    first = conf_dir / "10-bridge.conflist"
    write_json(first, bridge_conflist(Path("/tmp/ipam")))
    keeper = ChainKeeper(InstallConfig(bin_dir, conf_dir, SOCKET))
    assert keeper.ensure() is True
    assert keeper.ensure() is False  # nothing changed, nothing written

    write_json(first, bridge_conflist(Path("/tmp/ipam")))  # the primary CNI rewrites its file
    assert keeper.ensure() is True
    assert plugin_types(first) == ["bridge", "portmap", "ztunnel-cni"]

    # A single-plugin .conf sorting first becomes the primary: chained as a list, the old one cleaned.
    earlier = conf_dir / "05-cilium.conf"
    write_json(earlier, {"cniVersion": "0.4.0", "name": "cilium", "type": "cilium-cni", "mtu": 1450})
    assert keeper.ensure() is True
    assert not earlier.exists()
    assert read_json(conf_dir / "05-cilium.conflist") == {
        "cniVersion": "0.4.0",
        "name": "cilium",
        "plugins": [{"type": "cilium-cni", "mtu": 1450}, {"type": "ztunnel-cni", "agentSocket": SOCKET}],
    }
    assert plugin_types(first) == ["bridge", "portmap"]
    assert primary_conf(conf_dir) == conf_dir / "05-cilium.conflist"


def test_chaining_replaces_an_earlier_copy_and_refuses_what_is_not_a_configuration() -> None:
    entry = {"type": "ztunnel-cni", "agentSocket": "/new.sock"}
    conf = {"name": "n", "plugins": [{"type": "ztunnel-cni", "agentSocket": "/old.sock"}, {"type": "bridge"}]}
    assert chained(conf, entry)["plugins"] == [{"type": "bridge"}, entry]
    with pytest.raises(ValueError):
        chained({"name": "n", "plugins": "bridge"}, entry)
    with pytest.raises(ValueError):
        chained({"name": "n"}, entry)


def test_the_agent_refuses_half_an_install_and_a_broken_primary(dirs: tuple[Path, Path]) -> None:
    bin_dir, conf_dir = dirs
    (conf_dir / "10-broken.conflist").write_text("{not json")
    sockets = conf_dir.parent / "run"
    base = [
        ZTUNNEL,
        "cni-agent",
        "--zds-socket",
        str(sockets / "z.sock"),
        "--cni-socket",
        str(sockets / "c.sock"),
    ]
    for extra, message in (
        (["--cni-bin-dir", str(bin_dir)], "--cni-bin-dir and --cni-conf-dir go together"),
        (["--uninstall"], "--uninstall needs --cni-bin-dir and --cni-conf-dir"),
        (
            [
                "--cni-bin-dir",
                str(bin_dir),
                "--cni-conf-dir",
                str(conf_dir),
                "--state-file",
                str(sockets / "s"),
            ],
            "10-broken.conflist is not JSON",
        ),
    ):
        done = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 1
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("ztunnel: cni-agent: ") and message in last, done.stderr
        assert "Traceback" not in done.stderr
    assert (conf_dir / "10-broken.conflist").read_text() == "{not json"


# --- root: a node whose runtime runs the chained list ---------------------------------------------


def run_list(
    node: Node, conflist: Path, cni_path: list[Path], command: str, pod: Pod
) -> dict[str, Any] | None:
    """Run a network configuration list for `pod` as libcni does: each plugin found on CNI_PATH, its
    configuration with the list's name and version and the previous result; DEL in reverse."""
    conf = read_json(conflist)
    plugins = conf["plugins"] if command == "ADD" else list(reversed(conf["plugins"]))
    prev = pod.result
    for plugin in plugins:
        binary = next(d / plugin["type"] for d in cni_path if (d / plugin["type"]).exists())
        stdin = {**plugin, "name": conf["name"], "cniVersion": conf["cniVersion"]}
        if prev is not None:
            stdin["prevResult"] = prev
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": pod.container_id,
            "CNI_NETNS": pod.netns_path,
            "CNI_IFNAME": "eth0",
            "CNI_PATH": ":".join(str(d) for d in cni_path),
            "CNI_ARGS": pod.cni_args,
        }
        done = subprocess.run(
            ["ip", "netns", "exec", node.ns.name, str(binary)],
            input=json.dumps(stdin),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, f"{plugin['type']} {command}: {done.stdout} {done.stderr}"
        if command == "ADD":
            prev = json.loads(done.stdout)
    return prev


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    require_root("ip", "iptables", "nsenter")
    require_tools(
        *(str(CNI_BIN_DIR / p) for p in ("bridge", "host-local", "portmap")),
        hint="containernetworking-plugins",
    )
    node = Node(tmp_path)
    try:
        yield node
    finally:
        node.close()


@pytest.mark.root
@pytest.mark.timeout(120)
def test_the_agent_installs_the_plugin_and_a_pod_runs_through_the_chained_list(
    node: Node, tmp_path: Path, fleet: Fleet
) -> None:
    bin_dir, conf_dir = tmp_path / "host" / "opt-cni-bin", tmp_path / "host" / "etc-cni-net.d"
    conf_dir.mkdir(parents=True)
    primary = conf_dir / "10-bridge.conflist"
    original = bridge_conflist(node.dir / "ipam", node.subnet)
    write_json(primary, original)
    install_args = ("--cni-bin-dir", str(bin_dir), "--cni-conf-dir", str(conf_dir))

    node.start_agent(*install_args)
    eventually(lambda: plugin_types(primary) == ["bridge", "portmap", "ztunnel-cni"], "the plugin chained")
    assert read_json(primary)["plugins"][-1] == {
        "type": "ztunnel-cni",
        "agentSocket": str(node.cni_socket),
        "excludeNamespaces": ["kube-system", "istio-system"],
    }
    local = tmp_path / "local.yaml"
    local.write_text("workloads: []\n")
    ztunnel = fleet.proxy(
        {
            "PROXY_MODE": "shared",
            "INPOD_UDS": str(node.zds_socket),
            "XDS_ADDRESS": "",
            "LOCAL_XDS_PATH": str(local),
            "FAKE_CA": "true",
            "CONNECTION_TERMINATION_DEADLINE": "1s",
        },
        netns=node.ns.name,
    )
    ztunnel.spawn()
    try:
        eventually(
            lambda: "snapshot of 0 pod(s) sent" in node.agent_output(),
            lambda: f"ztunnel connected to the agent:\n{node.agent_output()}\n{ztunnel.log()}",
        )
        pod = node.new_pod("web")
        cni_path = [bin_dir, CNI_BIN_DIR]
        result = run_list(node, primary, cni_path, "ADD", pod)
        assert result is not None
        pod.result = result
        pod_ip = str(result["ips"][0]["address"]).split("/")[0]
        assert pod.exec("ip", "-4", "-o", "addr", "show", "eth0").stdout.split()[3].startswith(pod_ip)
        assert "15001" in pod.iptables_save()  # the pod's redirection, written by the agent

        # A pod of an excluded namespace (ztunnel's own, say) gets its network and no redirection.
        system = node.new_pod("coredns", namespace="kube-system")
        system.result = run_list(node, primary, cni_path, "ADD", system)
        assert system.result is not None and system.result["ips"]
        assert "15001" not in system.iptables_save()
        assert "coredns" not in node.agent_output()

        # The primary CNI rewrites its file (e.g. on its own upgrade): the agent chains it again.
        write_json(primary, original)
        eventually(
            lambda: plugin_types(primary)[-1:] == ["ztunnel-cni"], "the plugin chained again", timeout=10
        )

        run_list(node, primary, cni_path, "DEL", pod)
    finally:
        ztunnel.terminate(timeout=15)
    assert node.stop_agent() == 0
    # Stopping the agent leaves the plugin in place (a new agent takes over); uninstall removes it.
    assert plugin_types(primary)[-1] == "ztunnel-cni"
    done = subprocess.run(
        [ZTUNNEL, "cni-agent", "--uninstall", *install_args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert read_json(primary) == original
    assert not (bin_dir / "ztunnel-cni").exists()
