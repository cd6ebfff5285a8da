"""A PEM key pair into an `ssl.SSLContext`, which loads one only from a file: through an anonymous
file in memory (memfd_create) named by its /proc/self/fd path, that no other process can open and
that is gone once closed; without one, a private file (0600 in a 0700 directory, in /dev/shm if
any) deleted right after."""

from __future__ import annotations

import contextlib
import os
import ssl


def load_pem_pair(ctx: ssl.SSLContext, key_pem: bytes, chain_pem: bytes) -> None:
    """Load a PEM key and its chain into `ctx`."""
    pair = (key_pem if key_pem.endswith(b"\n") else key_pem + b"\n") + chain_pem
    if not (hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")):
        _load_through_private_file(ctx, pair)
        return
    fd = os.memfd_create("hbone-pair", os.MFD_CLOEXEC)
    try:
        _write_all(fd, pair)
        ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _load_through_private_file(ctx: ssl.SSLContext, pair: bytes) -> None:
    import tempfile  # only here: a proxy on Linux never holds it

    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    directory = tempfile.mkdtemp(prefix="hbone-", dir=shm)
    path = os.path.join(directory, "pair.pem")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, pair)
        finally:
            os.close(fd)
        ctx.load_cert_chain(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.rmdir(directory)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
