"""Whether a process runs: the one check that a pid's process has not ended."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ("alive",)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie (exited, not yet
    reaped by its parent, which in a container whose first process reaps nothing may
    be never).  Another user's process counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        # "pid (comm) state ...": comm may hold spaces and parentheses.
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True
