"""`StartupError`: how `ztunnel proxy` reports a start-up failure, in one line and no traceback.

Its own module so the front door can catch it without importing the control runtime, which the
proxy loads only after its data-plane workers are forked (`ztunnel/app.py`).
"""

from __future__ import annotations


class StartupError(Exception):
    """A start-up failure to report in one line (no traceback)."""
