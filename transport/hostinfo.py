"""Who and where this process is: used to decide whether a peer shares our host."""

from __future__ import annotations

import functools
import os
import socket

from .wire import HostInfo

__all__ = ["local_host", "same_host"]


@functools.cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def local_host() -> HostInfo:
    """This process's :class:`HostInfo` (read fresh: the pid changes across forks)."""
    return HostInfo(hostname=socket.gethostname(), boot_id=_boot_id(), pid_ns=_pid_ns(), pid=os.getpid())


def same_host(a: HostInfo, b: HostInfo) -> tuple[bool, str]:
    """Whether ``a`` and ``b`` can see each other's ``/proc``: same kernel boot, same pid namespace."""
    if not a.boot_id or not b.boot_id:
        return False, "boot id unknown (no /proc/sys/kernel/random/boot_id)"
    if a.boot_id != b.boot_id:
        return False, f"different hosts ({a.hostname} vs {b.hostname})"
    if a.pid_ns != b.pid_ns:
        return False, "same kernel but different pid namespaces (containers)"
    return True, f"same host {a.hostname}"
