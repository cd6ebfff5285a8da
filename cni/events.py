"""The pod events the `ztunnel-cni` plugin reports to the node agent, and the agent's replies.

The CNI socket is AF_UNIX + SOCK_STREAM. The plugin connects, writes one request as a JSON object on
one line, and reads one reply line; then either side closes.

    request: {"command": "ADD"|"DEL"|"CHECK", "uid": …, "name": …, "namespace": …,
              "serviceAccount": …, "netns": …, "containerId": …, "ips": ["10.88.0.5", …]}
    reply:   {"ok": true}  or  {"ok": false, "code": <CNI error code>, "error": "<one line>"}

The codes are the CNI spec's (11: try again later), plus ours from 100. Pure encoding and decoding,
standard library only: the plugin imports this on every pod event and must start fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

COMMANDS = ("ADD", "DEL", "CHECK")
MAX_LINE = 64 * 1024

# CNI spec error codes (https://github.com/containernetworking/cni/blob/main/SPEC.md#error)
INCOMPATIBLE_VERSION = 1
INVALID_ENVIRONMENT = 4
IO_FAILURE = 5
DECODE_FAILURE = 6
INVALID_CONFIG = 7
TRY_AGAIN_LATER = 11
# ours
AGENT_FAILURE = 100  # the agent could not enroll the pod: netns unusable, rules not written
ZTUNNEL_REFUSED = 101  # ztunnel answered the AddWorkload with an error
NOT_ENROLLED = 102  # CHECK: the agent does not know the pod, or its rules are missing


class EventError(ValueError):
    """A request or reply line that is not what the protocol says."""


@dataclass(frozen=True)
class PodEvent:
    command: str
    uid: str
    name: str = ""
    namespace: str = ""
    service_account: str = "default"
    netns: str = ""
    container_id: str = ""
    ips: tuple[str, ...] = field(default=())

    def encode(self) -> bytes:
        body = {"command": self.command, "uid": self.uid, **pod_json(self)}
        return json.dumps(body).encode() + b"\n"


class PodFields(Protocol):
    """What a pod event and the agent's pod record both carry (and write with the same keys)."""

    @property
    def name(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def service_account(self) -> str: ...
    @property
    def netns(self) -> str: ...
    @property
    def container_id(self) -> str: ...
    @property
    def ips(self) -> tuple[str, ...]: ...


POD_FIELDS = ("name", "namespace", "service_account", "netns", "container_id", "ips")


def pod_json(pod: PodFields) -> dict[str, Any]:
    return {
        "name": pod.name,
        "namespace": pod.namespace,
        "serviceAccount": pod.service_account,
        "netns": pod.netns,
        "containerId": pod.container_id,
        "ips": list(pod.ips),
    }


def pod_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The pod fields of a JSON object (as `pod_json` writes them), checked; keyword arguments of
    `PodEvent` and `cni.pods.Pod`. Raises EventError naming the field."""
    ips = body.get("ips", [])
    if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
        raise EventError("field 'ips' must be a list of strings")
    return {
        "name": _string(body, "name"),
        "namespace": _string(body, "namespace"),
        "service_account": _string(body, "serviceAccount", "default") or "default",
        "netns": _string(body, "netns"),
        "container_id": _string(body, "containerId"),
        "ips": tuple(ips),
    }


@dataclass(frozen=True)
class Reply:
    ok: bool
    code: int = 0
    error: str = ""

    def encode(self) -> bytes:
        body: dict[str, Any] = (
            {"ok": True} if self.ok else {"ok": False, "code": self.code, "error": self.error}
        )
        return json.dumps(body).encode() + b"\n"


def load_json(data: bytes) -> Any:
    """JSON from untrusted bytes: every failure is a ValueError, never a RecursionError (nesting
    deeper than the interpreter's stack) nor a traceback. A number of more than 4300 digits is one
    of those ValueErrors, which `int()` raises inside the decoder."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _object(line: bytes, what: str) -> dict[str, Any]:
    try:
        value = load_json(line)
    except ValueError as e:  # also UnicodeDecodeError and json.JSONDecodeError
        raise EventError(f"{what} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise EventError(f"{what} is not a JSON object")
    return value


def _string(body: dict[str, Any], key: str, default: str = "") -> str:
    value = body.get(key, default)
    if not isinstance(value, str):
        raise EventError(f"field {key!r} must be a string")
    return value


def decode_event(line: bytes) -> PodEvent:
    body = _object(line, "request")
    command = _string(body, "command")
    if command not in COMMANDS:
        raise EventError(f"request command {command!r} is not one of {', '.join(COMMANDS)}")
    uid = _string(body, "uid")
    if not uid:
        raise EventError("request without a uid")
    event = PodEvent(command=command, uid=uid, **pod_fields(body))
    if command == "ADD":
        missing = [k for k in ("name", "namespace", "netns") if not getattr(event, k)]
        if missing:
            raise EventError(f"ADD request without {', '.join(missing)}")
    if event.netns and not event.netns.startswith("/"):
        raise EventError(f"request netns {event.netns!r} is not an absolute path")
    return event


def decode_reply(line: bytes) -> Reply:
    body = _object(line, "reply")
    ok = body.get("ok")
    if ok is True:
        return Reply(True)
    code, error = body.get("code"), body.get("error")
    if ok is not False or not isinstance(code, int) or not isinstance(error, str):
        raise EventError("reply is not {ok: true} or {ok: false, code: int, error: str}")
    return Reply(False, code, error)
