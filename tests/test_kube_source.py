"""`--kube PATH` as the control plane reads it: start-up errors a user sees, `--config` beside it,
and the watch (files added, broken, removed)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.snapshot import Snapshot
from controlplane.source import ConfigSource
from mesh.localconfig import LocalConfigError
from tests.waiting import eventually_async
from xds.convert import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL

POD = """\
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: demo, labels: {{app: a, version: v1}}}}
spec: {{serviceAccountName: {name}}}
status: {{podIP: {ip}}}
"""

LOCAL = """\
workloads:
  - uid: {uid}
    name: vm
    namespace: demo
    workloadIps: ["10.9.0.1"]
"""


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ztunnel", "control-plane", "--listen", "127.0.0.1:0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("apiVersion: v1\nkind: Pod\nmetadata: {name: [}\n", "bad.yaml: line 3, column 19: invalid YAML"),
        (None, "bad.yaml: no such file or directory"),
    ],
)
def test_start_up_refuses_what_it_cannot_read(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "bad.yaml"
    if content is not None:
        path.write_text(content)
    r = run("--kube", str(path), "--ca-dir", str(tmp_path / "ca"))
    assert r.returncode == 1
    assert r.stderr.startswith("ztunnel: control-plane: ") and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_nothing_to_serve() -> None:
    r = run()
    assert r.returncode == 1
    assert (
        r.stderr.strip()
        == "ztunnel: control-plane: nothing to serve: give --config FILE, --kube PATH, or both"
    )


def test_config_and_kube_combine(tmp_path: Path) -> None:
    local, manifests = tmp_path / "local.yaml", tmp_path / "pods.yaml"
    local.write_text(LOCAL.format(uid="hand//vm"))
    manifests.write_text(POD.format(name="p", ip="10.0.0.1"))
    snapshot = ConfigSource(local, kube=manifests).load()
    assert set(snapshot.resources[ADDRESS_TYPE_URL]) == {"hand//vm", "Kubernetes//Pod/demo/p"}
    local.write_text(LOCAL.format(uid="Kubernetes//Pod/demo/p"))
    with pytest.raises(LocalConfigError, match="duplicate resource name 'Kubernetes//Pod/demo/p'"):
        ConfigSource(local, kube=manifests).load()


async def test_the_watch_follows_files_added_broken_and_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "a.yaml").write_text(POD.format(name="a", ip="10.0.0.1"))
    source = ConfigSource(None, 0.02, kube=manifests)
    published: list[Snapshot] = [source.load()]
    watch = asyncio.create_task(source.watch(published.append))

    def uids() -> set[str]:
        return set(published[-1].resources[ADDRESS_TYPE_URL])

    try:
        assert uids() == {"Kubernetes//Pod/demo/a"}
        (manifests / "b.yaml").write_text(POD.format(name="b", ip="10.0.0.2"))
        await eventually_async(
            lambda: uids() == {"Kubernetes//Pod/demo/a", "Kubernetes//Pod/demo/b"}, "b added"
        )
        # A broken save of b.yaml keeps b; a's edit still applies.
        count = len(published)
        tmp = manifests / ".b.tmp"
        tmp.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: [\n")
        os.replace(tmp, manifests / "b.yaml")
        await eventually_async(lambda: "keeping what it held before" in caplog.text, "the refusal")
        (manifests / "a.yaml").write_text(POD.format(name="a2", ip="10.0.0.3"))
        await eventually_async(lambda: "Kubernetes//Pod/demo/a2" in uids(), "a's edit")
        assert uids() == {"Kubernetes//Pod/demo/a2", "Kubernetes//Pod/demo/b"}
        assert len(published) > count
        (manifests / "b.yaml").unlink()
        await eventually_async(lambda: uids() == {"Kubernetes//Pod/demo/a2"}, "b removed")
        assert published[-1].resources[AUTHORIZATION_TYPE_URL] == {}
    finally:
        watch.cancel()
