"""The service's own worker threads, as the OS sees them: named, and the background ones
given a lower CPU priority."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading


def name_os_thread(name: str) -> None:
    """Name this thread for the OS too (``top -H``, ``/proc/PID/task/*/comm``): Linux only,
    best effort."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def background_thread(name: str, nice: int) -> None:
    """A thread initializer: named for the OS, and ``nice`` steps below the process's CPU
    priority (Linux gives each thread its own nice value; best effort elsewhere)."""
    name_os_thread(name)
    with contextlib.suppress(Exception):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + nice)
