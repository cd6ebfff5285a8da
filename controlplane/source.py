"""The YAML file the control plane serves: loading it, and watching it for changes.

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
from collections.abc import Callable
from pathlib import Path

from controlplane.snapshot import Snapshot, snapshot_from_config
from xds.localconfig import LocalConfigError, parse_local_config

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL = 0.3

# What a stat says about the file's content, or None when the file cannot be stat'ed.
FileSignature = tuple[int, int, int, int] | None


def _signature(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class ConfigSource:
    """One local-config file, read into snapshots."""

    def __init__(self, path: Path, poll_interval: float = DEFAULT_POLL_INTERVAL) -> None:
        self.path = path
        self.poll_interval = poll_interval
        self._loaded: FileSignature = None

    def load(self) -> Snapshot:
        """Read and convert the file now; raise `LocalConfigError` naming the file, key path and reason."""
        source = os.fspath(self.path)
        try:
            with open(self.path, "rb") as f:
                self._loaded = _signature(os.fstat(f.fileno()))
                data = f.read()
        except OSError as e:
            raise LocalConfigError(f"{source}: cannot read: {e.strerror or e}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise LocalConfigError(f"{source}: not UTF-8 text") from None
        return snapshot_from_config(parse_local_config(text, source), source)

    def _stat(self) -> FileSignature:
        try:
            return _signature(os.stat(self.path))
        except OSError:
            return None

    async def watch(self, publish: Callable[[Snapshot], None]) -> None:
        """Poll the file forever; hand every good new snapshot to `publish`."""
        pending: FileSignature = self._loaded
        while True:
            await asyncio.sleep(self.poll_interval)
            seen = self._stat()
            if seen == self._loaded:
                pending = seen
                continue
            if seen != pending:  # changed since the last poll: let the writer finish
                pending = seen
                continue
            # Remember it even when refused, so one bad save is reported once, not every poll.
            self._loaded = seen
            try:
                snapshot = self.load()
            except LocalConfigError as e:
                log.error("refused the changed configuration, still serving the last good one: %s", e.message)
                continue
            except Exception:  # a bug in reading one save must not end the watch: later saves count
                log.exception("refused the changed configuration, still serving the last good one")
                continue
            publish(snapshot)
