"""What every benchmark script records about the machine it ran on.

Imported by the scripts in this folder as ``_common`` (a script's own folder is first on
``sys.path``); not part of the library.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["environment", "loadavg", "usable_cpus", "write_results"]


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def environment(root: Path, threads: int, idle_fraction: Callable[[], float | None]) -> dict[str, Any]:
    """Versions, machine, load and git commit, for a results file (``idle_fraction`` samples the
    share of idle CPU just before the run: each script measures it its own way)."""
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "loadavg_start": loadavg(),
        "cpu_idle_before_start": idle_fraction(),
        "torch_threads": threads,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "git_commit": commit,
        "start_method": "spawn",
        "argv": sys.argv,
    }


def write_results(path: Path, doc: dict[str, Any]) -> None:
    """Write a results document as JSON (creating its folder) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str))
    print(f"results written to {path}")
