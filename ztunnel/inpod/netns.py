"""Sockets made inside a pod's network namespace.

`setns(2)` switches only the calling OS thread. Python 3.11 has no `os.setns`, so it is called through
`ctypes`. The switch is always: enter the pod's namespace, create the socket, switch straight back, all
on the loop's thread and without yielding to the event loop in between; a socket keeps the namespace
it was created in for its whole life, wherever it is later bound, connected or read.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import socket
from collections.abc import Iterator

from ztunnel.sockets import SO_MARK, SocketFactory, SocketOptions

CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)
_libc.setns.restype = ctypes.c_int


def setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def current_netns_fd() -> int:
    """An fd of the calling thread's network namespace (close-on-exec)."""
    return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)


class PodNetns:
    """A pod's network namespace, held open by its fd for the life of the pod's proxy."""

    def __init__(self, fd: int, key: tuple[int, int]) -> None:
        self.fd = fd
        self.key = key  # (st_dev, st_ino): how two fds are known to name the same namespace
        self._home: int | None = None

    def __repr__(self) -> str:
        return f"PodNetns(inode={self.key[1]})"

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the body with the calling thread inside this namespace. The body must not await."""
        if self._home is None:
            self._home = current_netns_fd()
        setns(self.fd)
        try:
            yield
        finally:
            try:
                setns(self._home)
            except OSError as e:  # pragma: no cover - the thread would stay in the pod's namespace
                os.write(2, f"ztunnel: cannot return to the host network namespace: {e}\n".encode())
                os._exit(70)

    def close(self) -> None:
        for fd in (self.fd, self._home):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd = -1
        self._home = None


class NetnsSocketFactory(SocketFactory):
    """The socket factory of one pod's proxy: every socket is created inside the pod's namespace."""

    def __init__(self, netns: PodNetns, options: SocketOptions) -> None:
        super().__init__(options)
        self.netns = netns

    def _new(self, family: int, kind: int = socket.SOCK_STREAM) -> socket.socket:
        with self.netns.entered():
            return super()._new(family, kind)


def check_privileges(mark: int | None) -> None:
    """In-pod mode needs setns(CLONE_NEWNET) and SO_MARK (fatal at start-up, as in the reference).

    Raises OSError naming what failed."""
    home = current_netns_fd()
    try:
        try:
            setns(home)
        except OSError as e:
            raise OSError(
                e.errno, f"cannot switch network namespaces (needs CAP_SYS_ADMIN): {e.strerror}"
            ) from None
    finally:
        os.close(home)
    if mark is not None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
            except OSError as e:
                raise OSError(
                    e.errno or errno.EPERM, f"cannot set SO_MARK (needs CAP_NET_ADMIN): {e.strerror}"
                ) from None
