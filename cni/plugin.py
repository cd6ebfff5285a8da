"""`ztunnel-cni`: the CNI plugin (spec 1.0.0) that enrolls pods in in-pod mode.

The container runtime runs it chained after the pod's main plugin, with the command and the pod in the
environment (`CNI_COMMAND`, `CNI_CONTAINERID`, `CNI_NETNS`, `CNI_IFNAME`, `CNI_ARGS`, `CNI_PATH`) and
the network configuration, including the previous plugin's result, on stdin. It changes nothing in the
pod itself: it reports the event to the node agent on `agentSocket` (the protocol is in `cni.events`)
and, for ADD, prints the `prevResult` it was given.

* ADD returns once the agent says the redirection is in place and ztunnel acknowledged the pod, and
  fails otherwise, so that no pod starts unprotected.
* DEL always succeeds, also when the agent or ztunnel is down: a pod must always be deletable.
* CHECK asks the agent whether the pod is enrolled and its rules present.
* A pod with `ISTIO_AMBIENT=disabled` in `CNI_ARGS`, or in one of the configuration's
  `excludeNamespaces` (the node's own system pods, ztunnel's among them), is passed through on ADD
  and CHECK; the agent is not contacted.

Failures are CNI error objects on stdout with a non-zero exit. The plugin runs for every pod event, so
it imports only the standard library (no grpc, no protobuf).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cni import DEFAULT_CNI_SOCKET
from cni.events import (
    DECODE_FAILURE,
    INCOMPATIBLE_VERSION,
    INVALID_CONFIG,
    INVALID_ENVIRONMENT,
    MAX_LINE,
    TRY_AGAIN_LATER,
    EventError,
    PodEvent,
    Reply,
    decode_reply,
    load_json,
)

SPEC_VERSION = "1.0.0"
SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0")
COMMANDS = ("ADD", "DEL", "CHECK", "VERSION")
# An ADD may wait for ztunnel to connect (the agent's --ztunnel-wait) and then for its answer (5 s).
ADD_TIMEOUT = 30.0
DEL_TIMEOUT = 10.0
_REQUIRED_ENV: dict[str, tuple[str, ...]] = {
    "ADD": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"),
    "CHECK": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"),
    "DEL": ("CNI_CONTAINERID", "CNI_IFNAME"),  # the namespace may be gone already
}


class CniError(Exception):
    """A failure reported to the runtime as a CNI error object."""

    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code, self.msg, self.details = code, msg, details

    def to_json(self, cni_version: str) -> dict[str, Any]:
        return {"cniVersion": cni_version, "code": self.code, "msg": self.msg, "details": self.details}


@dataclass(frozen=True)
class Invocation:
    """What the runtime put in the environment."""

    command: str
    container_id: str
    netns: str
    ifname: str
    args: dict[str, str]


@dataclass(frozen=True)
class NetConf:
    cni_version: str
    name: str
    agent_socket: str
    prev_result: dict[str, Any] | None
    exclude_namespaces: tuple[str, ...] = ()


def parse_cni_args(text: str) -> dict[str, str]:
    """`K=V;K=V` as in CNI_ARGS; empty pairs are skipped, a pair without `=` is an error."""
    args: dict[str, str] = {}
    for pair in text.split(";"):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CniError(INVALID_ENVIRONMENT, "invalid CNI_ARGS", f"{pair!r} is not KEY=VALUE")
        args[key] = value
    return args


def parse_environment(env: Mapping[str, str]) -> Invocation:
    command = env.get("CNI_COMMAND", "")
    if not command:
        raise CniError(INVALID_ENVIRONMENT, "CNI_COMMAND is not set")
    if command not in COMMANDS:
        raise CniError(INVALID_ENVIRONMENT, f"unknown CNI_COMMAND {command!r}", f"expected one of {COMMANDS}")
    missing = [k for k in _REQUIRED_ENV.get(command, ()) if not env.get(k)]
    if missing:
        raise CniError(INVALID_ENVIRONMENT, f"{', '.join(missing)} not set", f"required for {command}")
    return Invocation(
        command=command,
        container_id=env.get("CNI_CONTAINERID", ""),
        netns=env.get("CNI_NETNS", ""),
        ifname=env.get("CNI_IFNAME", ""),
        args=parse_cni_args(env.get("CNI_ARGS", "")),
    )


def parse_config(stdin: bytes) -> NetConf:
    try:
        conf = load_json(stdin)
    except ValueError as e:  # not UTF-8, not JSON, nested too deeply, a number too long
        raise CniError(DECODE_FAILURE, "network configuration is not JSON", str(e)) from None
    if not isinstance(conf, dict):
        raise CniError(DECODE_FAILURE, "network configuration is not a JSON object")
    version = conf.get("cniVersion")
    if not isinstance(version, str) or not version:
        raise CniError(INVALID_CONFIG, "network configuration without cniVersion")
    if version not in SUPPORTED_VERSIONS:
        raise CniError(
            INCOMPATIBLE_VERSION,
            f"unsupported cniVersion {version!r}",
            f"supported: {', '.join(SUPPORTED_VERSIONS)}",
        )
    name = conf.get("name", "")
    agent_socket = conf.get("agentSocket", DEFAULT_CNI_SOCKET)
    if not isinstance(name, str):
        raise CniError(INVALID_CONFIG, "network configuration: name must be a string")
    if not isinstance(agent_socket, str) or not agent_socket:
        raise CniError(INVALID_CONFIG, "network configuration: agentSocket must be a non-empty string")
    prev = conf.get("prevResult")
    if prev is not None and not isinstance(prev, dict):
        raise CniError(INVALID_CONFIG, "network configuration: prevResult must be an object")
    excluded = conf.get("excludeNamespaces", [])
    if not isinstance(excluded, list) or not all(isinstance(n, str) for n in excluded):
        raise CniError(INVALID_CONFIG, "network configuration: excludeNamespaces must be a list of strings")
    return NetConf(version, name, agent_socket, prev, tuple(excluded))


def pod_ips(prev_result: Mapping[str, Any]) -> tuple[str, ...]:
    """The pod's addresses from the previous result's `ips[].address` (CIDR notation)."""
    ips = prev_result.get("ips", [])
    if not isinstance(ips, list):
        raise CniError(INVALID_CONFIG, "prevResult: ips must be a list")
    found = []
    for entry in ips:
        address = entry.get("address") if isinstance(entry, dict) else None
        try:
            # Only the CIDR text: `ip_interface` would also take the number 5 (or true) as an address.
            if not isinstance(address, str):
                raise ValueError(address)
            found.append(str(ipaddress.ip_interface(address).ip))
        except ValueError:
            raise CniError(INVALID_CONFIG, f"prevResult: invalid ips[].address {address!r}") from None
    return tuple(found)


def pod_event(command: str, inv: Invocation, ips: tuple[str, ...] = ()) -> PodEvent:
    args = inv.args
    uid = args.get("K8S_POD_UID") or inv.container_id
    name, namespace = args.get("K8S_POD_NAME", ""), args.get("K8S_POD_NAMESPACE", "")
    if command == "ADD" and not (name and namespace):
        raise CniError(
            INVALID_ENVIRONMENT,
            "CNI_ARGS: K8S_POD_NAME and K8S_POD_NAMESPACE are required to enroll a pod",
            "or set ISTIO_AMBIENT=disabled to pass it through",
        )
    return PodEvent(
        command=command,
        uid=uid,
        name=name,
        namespace=namespace,
        service_account=args.get("K8S_POD_SERVICE_ACCOUNT") or "default",
        netns=inv.netns,
        container_id=inv.container_id,
        ips=ips,
    )


def ask_agent(path: str, event: PodEvent, timeout: float) -> Reply:
    """Send one event to the agent and wait for its reply."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(event.encode())
            data = b""
            while b"\n" not in data and len(data) < MAX_LINE:
                chunk = sock.recv(MAX_LINE)
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        raise CniError(
            TRY_AGAIN_LATER, f"no answer from the ztunnel CNI agent within {timeout:g}s", path
        ) from None
    except OSError as e:
        raise CniError(
            TRY_AGAIN_LATER, "cannot reach the ztunnel CNI agent", f"{path}: {e.strerror or e}"
        ) from None
    if not data:
        raise CniError(TRY_AGAIN_LATER, "the ztunnel CNI agent closed the connection without a reply", path)
    try:
        return decode_reply(data.split(b"\n", 1)[0])
    except EventError as e:
        raise CniError(TRY_AGAIN_LATER, "invalid reply from the ztunnel CNI agent", str(e)) from None


Agent = Callable[[str, PodEvent, float], Reply]


def handle(env: Mapping[str, str], stdin: bytes, agent: Agent = ask_agent) -> str:
    """Run one invocation: the text for stdout, or CniError."""
    inv = parse_environment(env)
    if inv.command == "VERSION":
        return json.dumps({"cniVersion": SPEC_VERSION, "supportedVersions": list(SUPPORTED_VERSIONS)})
    conf = parse_config(stdin)
    enrolled = inv.args.get("ISTIO_AMBIENT", "").lower() != "disabled"

    if inv.command == "DEL":
        if enrolled:
            event = pod_event("DEL", inv)
            try:
                reply = agent(conf.agent_socket, event, DEL_TIMEOUT)
                if not reply.ok:
                    print(f"ztunnel-cni: DEL {event.uid}: {reply.error}", file=sys.stderr)
            except CniError as e:
                # The pod must go away anyway; the agent forgets it when it hears of it, or at restart.
                print(f"ztunnel-cni: DEL {event.uid}: {e.msg}: {e.details}", file=sys.stderr)
        return ""

    if conf.prev_result is None:
        raise CniError(
            INVALID_CONFIG,
            f"{inv.command} needs prevResult: ztunnel-cni runs chained after the pod's network plugin",
        )
    # The node's own pods (ztunnel's included: its ADD would wait for itself) stay out.
    enrolled = enrolled and inv.args.get("K8S_POD_NAMESPACE", "") not in conf.exclude_namespaces
    if inv.command == "CHECK":
        if conf.cni_version in ("0.3.0", "0.3.1"):
            raise CniError(INCOMPATIBLE_VERSION, f"CHECK is not defined for cniVersion {conf.cni_version}")
        if enrolled:
            _expect_ok(agent(conf.agent_socket, pod_event("CHECK", inv), DEL_TIMEOUT))
        return ""

    # ADD
    ips = pod_ips(conf.prev_result)
    if enrolled:
        _expect_ok(agent(conf.agent_socket, pod_event("ADD", inv, ips), ADD_TIMEOUT))
    return json.dumps({**conf.prev_result, "cniVersion": conf.cni_version})


def _expect_ok(reply: Reply) -> None:
    if not reply.ok:
        raise CniError(reply.code, reply.error)


def _error_version(stdin: bytes) -> str:
    """The cniVersion to answer an error in: the configuration's when it is one we speak."""
    try:
        version = load_json(stdin).get("cniVersion")
    except (ValueError, AttributeError):
        return SPEC_VERSION
    return version if version in SUPPORTED_VERSIONS else SPEC_VERSION


def main() -> int:
    stdin = b"" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer.read()
    try:
        out = handle(os.environ, stdin)
    except CniError as e:
        sys.stdout.write(json.dumps(e.to_json(_error_version(stdin))) + "\n")
        return 1
    if out:
        sys.stdout.write(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
