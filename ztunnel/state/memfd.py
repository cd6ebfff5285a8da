"""A state image in shared memory: the parent writes each into a sealed memfd (`write_image`), every
worker maps the same pages read-only (`map_image`), so the mesh is held once per node."""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Sequence

from ztunnel.state.image import StateImage

_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def write_image(chunks: Sequence[bytes]) -> tuple[int, int]:
    """A sealed memfd holding the image `chunks`: (fd, size). Its pages are shared memory, counted
    once however many processes map them."""
    fd = os.memfd_create("ztunnel-state", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        size = 0
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                n = os.write(fd, view)
                view, size = view[n:], size + n
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def map_image(fd: int, size: int) -> StateImage:
    """The image in a sealed memfd, mapped read-only (the fd may be closed after). A memfd that is
    not sealed against writes is refused: the image is read in place and must not change."""
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE == 0:
        raise ValueError("the state image's memfd is not sealed against writes")
    if size == 0 or os.fstat(fd).st_size != size:
        raise ValueError(f"the state image's memfd holds {os.fstat(fd).st_size} bytes, not {size}")
    return StateImage(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
