"""Network namespaces made for the capture topology and the tests (root only): made with `ip netns`,
joined by veth pairs, commands run inside, and entered by the harness's own thread just long enough
to open a socket inside one.

`setns(2)` switches only the calling OS thread, and Python 3.11 has no `os.setns`: it is called
through `ctypes`. A socket keeps the namespace it was created in, so `inside(ns)` around a
`socket()`/`connect()` (or a whole short HTTP request) is all the harness needs to reach an address
that exists only in that namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import uuid
from collections.abc import Iterator, Sequence

CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)  # the symbols already loaded (libc's): no library search
_libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)
_libc.setns.restype = ctypes.c_int


class NetnsError(Exception):
    """A namespace, a link or an address could not be set up; the message has the command's error."""


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def run(*args: str, check: bool = True, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """`args` run to their end; NetnsError (with what they said) when they fail and `check`."""
    done = subprocess.run(args, capture_output=True, input=input, timeout=30, check=False)
    if check and done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip()
        raise NetnsError(f"{' '.join(args)}: {said or f'exit {done.returncode}'}")
    return done


class Netns:
    """One namespace named `<prefix>-<random>`; `delete()` removes it (and its veth ends)."""

    def __init__(self, prefix: str) -> None:
        self.name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        run("ip", "netns", "add", self.name)
        self.path = f"/run/netns/{self.name}"
        self.exec("ip", "link", "set", "lo", "up")

    def exec(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        """`args` run inside the namespace to their end."""
        return run("ip", "netns", "exec", self.name, *args, check=check)

    def argv(self, args: Sequence[str]) -> list[str]:
        """`args` run inside the namespace (`ip netns exec` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.name, *args]

    def popen(self, args: Sequence[str], env: dict[str, str], log_path: str) -> subprocess.Popen[bytes]:
        """`args` started inside the namespace, their output to `log_path`."""
        with open(log_path, "wb") as log:
            return subprocess.Popen(self.argv(args), env=env, stdout=log, stderr=subprocess.STDOUT)

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """The calling thread in this namespace for the block, back in its own afterwards."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            target = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(target)
            finally:
                os.close(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(own)

    def delete(self) -> None:
        with contextlib.suppress(NetnsError):
            run("ip", "netns", "del", self.name)


def link(a: Netns, a_ip: str, b: Netns, b_ip: str, prefix_len: int = 24) -> None:
    """A veth pair between two namespaces, with an address on each end, both up."""
    tag = uuid.uuid4().hex[:6]
    va, vb = f"zba{tag}", f"zbb{tag}"
    run("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
    run("ip", "link", "set", va, "netns", a.name)
    run("ip", "link", "set", vb, "netns", b.name)
    for ns, dev, ip in ((a, va, a_ip), (b, vb, b_ip)):
        ns.exec("ip", "addr", "add", f"{ip}/{prefix_len}", "dev", dev)
        ns.exec("ip", "link", "set", dev, "up")
