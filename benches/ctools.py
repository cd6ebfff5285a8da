"""The C load tools (`benches/tools.c`): built once per source version with the system's `gcc`.

The binary goes to a cache dir (`$XDG_CACHE_HOME/ztunnel-bench`, else `~/.cache/ztunnel-bench`),
named by a hash of the source, so an edit rebuilds and concurrent runs share one build.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("tools.c")


class BuildError(Exception):
    """The C tools could not be built (no gcc, or the compiler failed)."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ztunnel-bench"


def build() -> Path:
    """The path of the built tools binary, compiling it first when this source has no build yet."""
    source = SOURCE.read_bytes()
    out = cache_dir() / f"tools-{hashlib.sha256(source).hexdigest()[:16]}"
    if out.exists():
        return out
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise BuildError("no C compiler: install gcc (apt-get install gcc libc6-dev)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: a concurrent run never executes half a file.
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tools-")
    os.close(fd)
    try:
        done = subprocess.run(
            [gcc, "-O2", "-Wall", "-pthread", "-o", tmp, str(SOURCE)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise BuildError(f"gcc failed on {SOURCE}: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
