"""The enrolled pods the agent knows, and the state file that keeps them across agent restarts.

The file is JSON, `{"version": 1, "pods": {uid: {name, namespace, serviceAccount, netns, containerId,
ips}}}`, replaced atomically (write aside, fsync, rename) on every change, so a crash leaves either the
old or the new list. The netns fd a pod's entry holds is not persisted: after a restart the agent opens
the path again, and a path that no longer opens means the pod went away while the agent was down.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cni.events import POD_FIELDS, PodEvent, pod_fields, pod_json

STATE_VERSION = 1


class StateFileError(Exception):
    """The state file exists but cannot be read as ours."""


@dataclass
class Pod:
    uid: str
    name: str
    namespace: str
    service_account: str
    netns: str  # path of the pod's network namespace, e.g. /var/run/netns/<x>
    container_id: str = ""
    ips: tuple[str, ...] = ()
    fd: int | None = field(default=None, compare=False)  # the netns, held open while enrolled

    @property
    def display(self) -> str:
        return f"{self.namespace}/{self.name}"

    def to_json(self) -> dict[str, Any]:
        return pod_json(self)

    @classmethod
    def from_json(cls, uid: str, body: Any) -> Pod:
        """Raises ValueError (an EventError) naming what is wrong."""
        if not isinstance(body, dict):
            raise ValueError("not an object")
        pod = cls(uid=uid, **pod_fields(body))
        if not (pod.name and pod.namespace and pod.netns):
            raise ValueError("name, namespace and netns are required")
        return pod

    @classmethod
    def from_event(cls, event: PodEvent) -> Pod:
        return cls(uid=event.uid, **{f: getattr(event, f) for f in POD_FIELDS})


def load(path: Path) -> tuple[dict[str, Pod], list[str]]:
    """The pods in the state file (none when it does not exist), and a note per entry skipped."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, []
    except OSError as e:
        raise StateFileError(f"{path}: {e.strerror}") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise StateFileError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("pods"), dict):
        raise StateFileError(f"{path}: not a pod state file (expected an object with 'pods')")
    if body.get("version") != STATE_VERSION:
        raise StateFileError(
            f"{path}: unsupported version {body.get('version')!r} (expected {STATE_VERSION})"
        )
    pods: dict[str, Pod] = {}
    skipped: list[str] = []
    for uid, entry in body["pods"].items():
        try:
            pods[uid] = Pod.from_json(uid, entry)
        except ValueError as e:
            skipped.append(f"pods.{uid}: {e}")
    return pods, skipped


def save(path: Path, pods: dict[str, Pod]) -> None:
    """Replace the state file with `pods`, atomically. Raises OSError."""
    body = {"version": STATE_VERSION, "pods": {uid: pod.to_json() for uid, pod in sorted(pods.items())}}
    data = (json.dumps(body, indent=2) + "\n").encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
