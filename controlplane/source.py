"""What the control plane serves: the local-config YAML file, Kubernetes manifests, or both; loading
them, and watching them for changes.

The file is polled (its size, mtime and inode) rather than watched with inotify: editors save by
rename, by truncate-and-write, or through symlinks, and a stat comparison sees all of them. A change
is read only once the file has looked the same for one more poll, so a save caught half-written is
not mistaken for the new configuration. A file that fails to parse is refused with one log line and
the last good snapshot keeps being served.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, Protocol

from controlplane.kube.cluster import Options
from controlplane.kube.source import KubeInput
from controlplane.snapshot import Snapshot, snapshot_from_config
from mesh.localconfig import LocalConfig, LocalConfigError, parse_local_config

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL = 0.3

# What a stat says about the file's content, or None when the file cannot be stat'ed.
FileSignature = tuple[int, int, int, int] | None


def _signature(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class LocalConfigInput:
    """The local-config file (`--config`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.loaded: FileSignature = None

    def signature(self) -> FileSignature:
        try:
            return _signature(os.stat(self.path))
        except OSError:
            return None

    def read(self) -> LocalConfig:
        """Read and parse the file now; raise `LocalConfigError` naming the file, key path and reason."""
        source = os.fspath(self.path)
        try:
            with open(self.path, "rb") as f:
                self.loaded = _signature(os.fstat(f.fileno()))
                data = f.read()
        except OSError as e:
            raise LocalConfigError(f"{source}: cannot read: {e.strerror or e}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise LocalConfigError(f"{source}: not UTF-8 text") from None
        return parse_local_config(text, source, raw=False)


class Input(Protocol):
    path: Path
    loaded: Any  # the signature last read (or refused)

    def signature(self) -> Hashable: ...

    def read(self) -> LocalConfig: ...


class ConfigSource:
    """The local-config file, Kubernetes manifests (`kube`), or both, read into one snapshot.

    With both, the snapshot holds the resources of each; one name in both is an error, and the last
    good snapshot keeps being served.
    """

    def __init__(
        self,
        path: Path | None,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        *,
        kube: Path | None = None,
        kube_options: Options | None = None,
    ) -> None:
        self.inputs: list[Input] = []
        if path is not None:
            self.inputs.append(LocalConfigInput(path))
        if kube is not None:
            self.inputs.append(KubeInput(kube, kube_options))
        if not self.inputs:
            raise ValueError("a config path, a kube path, or both")
        self.poll_interval = poll_interval
        self._configs: list[LocalConfig] = [LocalConfig() for _ in self.inputs]

    @property
    def path(self) -> str:
        return " and ".join(os.fspath(i.path) for i in self.inputs)

    def load(self) -> Snapshot:
        """Read and convert everything now; raise `LocalConfigError` naming the file, key path and reason."""
        self._configs = [i.read() for i in self.inputs]
        return self._snapshot()

    def _snapshot(self) -> Snapshot:
        if len(self._configs) == 1:
            return snapshot_from_config(self._configs[0], self.path).prepare()
        merged = LocalConfig(
            workloads=tuple(w for c in self._configs for w in c.workloads),
            services=tuple(s for c in self._configs for s in c.services),
            policies=tuple(p for c in self._configs for p in c.policies),
        )
        return snapshot_from_config(merged, self.path).prepare()

    async def watch(self, publish: Callable[[Snapshot], None]) -> None:
        """Poll the inputs forever; hand every good new snapshot to `publish`."""
        pending: list[Hashable] = [i.loaded for i in self.inputs]
        while True:
            await asyncio.sleep(self.poll_interval)
            changed = False
            for n, source in enumerate(self.inputs):
                seen = source.signature()
                if seen == source.loaded or seen != pending[n]:
                    # Unchanged; or changed since the last poll: let the writer finish.
                    pending[n] = seen
                    continue
                # Remembered even when refused, so one bad save is reported once, not every poll.
                source.loaded = seen
                try:
                    self._configs[n] = source.read()
                    changed = True
                except LocalConfigError as e:
                    log.error(
                        "refused the changed configuration, still serving the last good one: %s", e.message
                    )
                except Exception:  # a bug in reading one save must not end the watch: later saves count
                    log.exception("refused the changed configuration, still serving the last good one")
            if not changed:
                continue
            try:
                snapshot = self._snapshot()
            except LocalConfigError as e:
                log.error("refused the changed configuration, still serving the last good one: %s", e.message)
                continue
            publish(snapshot)
