"""Child processes that end with their parent: the servers `make serve` starts, and the model
processes tritonserver starts. A parent killed with SIGKILL stops nobody, and its children kept
their ports and memory for good. A process gets a new parent the moment its parent dies."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1        # linux/prctl.h
WATCH_S = 0.5


def signalled_when_parent_dies(signum: int = signal.SIGTERM):
    """A preexec_fn by which Linux sends the child `signum` once its parent is gone; None
    elsewhere. Only for a child started before the parent has threads (a preexec_fn is not safe
    beside them); a child of our own watches its parent instead (when_parent_exits)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl       # loaded here: the child only calls it
    return lambda: prctl(PR_SET_PDEATHSIG, signum)


def when_parent_exits(parent: int, then: Callable[[], None], name: str) -> None:
    """Run `then` on a daemon thread of this name once this process's parent, pid `parent`, is gone."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        then()

    threading.Thread(target=watch, name=name, daemon=True).start()
