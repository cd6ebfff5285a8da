"""What every process of a proxy needs when it starts, and nothing else: `StartupError`, how
`ztunnel proxy` reports a start-up failure in one line and no traceback, and `set_pdeathsig`, how a
worker or the certificate helper dies with its parent.

Its own module so the front door can catch the error without importing the control runtime, which the
proxy loads only after its data-plane workers are forked (`ztunnel/start.py`), and so the certificate
helper's small process need not import the process model.
"""

from __future__ import annotations

import ctypes

PR_SET_PDEATHSIG = 1  # prctl(2)


class StartupError(Exception):
    """A start-up failure to report in one line (no traceback)."""


def set_pdeathsig(sig: int) -> None:
    """`sig` to this process when its parent dies. prctl from the symbols already loaded (libc's):
    looking libc up by name (`ctypes.util.find_library`) would run a subprocess each time."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
