"""The RL loop and parameter-server examples, run as a user runs them (real processes, CPU)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _step_rows(stdout: str, columns: int) -> list[list[str]]:
    """The per-step table: lines that start with a step number and have ``columns`` fields."""
    rows = [line.split() for line in stdout.splitlines()]
    return [r for r in rows if len(r) == columns and r[0].isdigit()]


def test_rl_loop_learns_and_generators_end_with_the_trainers_weights():
    steps = 20
    r = _run("examples/rl_loop.py", "--steps", str(steps), "--device", "cpu", timeout=110)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    rows = _step_rows(r.stdout, 7)  # step version sampled reward push_ms GB/s ok
    assert [int(row[0]) for row in rows] == list(range(1, steps + 1)), out
    for step, version, sampled, _, push_ms, gbps, ok in rows:
        assert int(version) == int(step) + 1 and sampled == step, out  # sampled with the newest version
        assert ok == "True" and float(push_ms) > 0 and float(gbps) > 0, out
    rewards = [float(row[3]) for row in rows]
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 >= 0.2, out
    assert re.search(r"^verified: gen-0 and gen-1 hold exactly the trainer's final weights \(version "
                     rf"{steps + 1}, sha256 [0-9a-f]{{16}}\)$", r.stdout, re.M), out
    assert "reward rose from" in r.stdout, out


def test_parameter_server_loss_falls():
    steps = 12
    r = _run("examples/parameter_server.py", "--steps", str(steps), timeout=90)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    rows = _step_rows(r.stdout, 5)  # step version loss push_ms ok
    assert [int(row[0]) for row in rows] == list(range(1, steps + 1)), out
    assert all(row[4] == "True" for row in rows), out
    losses = [float(row[2]) for row in rows]
    assert losses[-1] < losses[0] / 4, out
    assert "loss fell:" in r.stdout, out
