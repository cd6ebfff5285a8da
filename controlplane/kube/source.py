"""`--kube PATH` as an input of the control plane: read, converted, and polled like `--config`.

Each manifest file is read on its own: a file that does not parse keeps the objects it last gave
(logged once), so a half-finished edit of one file never empties the mesh; at start-up there is no
last good state, and the control plane refuses to start. Refusals and warnings are logged when they
first appear, so a reload repeats none of them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from controlplane.kube.cluster import Options
from controlplane.kube.index import Index, build
from controlplane.kube.manifests import ManifestError, Objects, manifest_files, objects_of, read_file
from mesh.localconfig import LocalConfig, LocalConfigError

log = logging.getLogger("controlplane.kube")

# (name, device, inode, size, mtime) of every manifest file; None when the path is missing.
Signature = tuple[tuple[str, int, int, int, int], ...] | None


class KubeInput:
    def __init__(self, path: Path, options: Options | None = None) -> None:
        self.path = path
        self.options = options or Options()
        self.loaded: Signature = None
        self.last: Index | None = None
        self._files: dict[Path, tuple[tuple[int, int, int, int], Objects]] = {}
        self._reported: set[str] = set()

    def signature(self) -> Signature:
        try:
            files = manifest_files(self.path)
            out = []
            for f in files:
                st = os.stat(f)
                out.append((f.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
            return tuple(out)
        except OSError:
            return None

    def _objects(self, path: Path, starting: bool) -> Objects | None:
        try:
            st = os.stat(path)
        except OSError as e:
            raise LocalConfigError(f"{os.fspath(path)}: cannot read: {e.strerror or e}") from None
        sig = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._files.get(path)
        if cached is not None and cached[0] == sig:
            return cached[1]
        try:
            objects = objects_of(read_file(path), os.fspath(path))
        except ManifestError as e:
            if starting:
                raise LocalConfigError(e.message) from None
            if cached is None:
                log.error("refused %s: %s", path, e.message)
                return None
            log.error("refused the changed file, keeping what it held before: %s", e.message)
            self._files[path] = (sig, cached[1])  # reported once, not every poll
            return cached[1]
        self._files[path] = (sig, objects)
        return objects

    def read(self) -> LocalConfig:
        """Read every file and convert; raise LocalConfigError only for what stops the start-up."""
        starting = self.last is None
        self.loaded = self.signature()
        if not self.path.exists():
            raise LocalConfigError(f"{os.fspath(self.path)}: no such file or directory")
        files = manifest_files(self.path)
        everything = Objects()
        for path in files:
            objects = self._objects(path, starting)
            if objects is not None:
                everything.objects += objects.objects
                everything.refusals += objects.refusals
                everything.ignored += objects.ignored
        for gone in set(self._files) - set(files):
            del self._files[gone]
        index = build(everything.objects, self.options)
        index.refusals[:0] = everything.refusals
        self._report(index, everything, len(files))
        self.last = index
        return index.config

    def _report(self, index: Index, objects: Objects, files: int) -> None:
        now = {f"refused: {r}" for r in index.refusals} | {f"warning: {w}" for w in index.warnings}
        for line in sorted(now - self._reported):
            (log.error if line.startswith("refused") else log.warning)("%s", line.split(": ", 1)[1])
        self._reported = now
        config = index.config
        ignored = ", ".join(f"{n} {kind}" for kind, n in sorted(objects.ignored.items()))
        log.info(
            "%s: %d file(s): %d workload(s), %d service(s), %d polic(ies) from %d object(s); %d refused%s",
            self.path,
            files,
            len(config.workloads),
            len(config.services),
            len(config.policies),
            len(objects.objects),
            len(index.refusals),
            f"; not read: {ignored}" if ignored else "",
        )
