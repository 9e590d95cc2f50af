"""examples/ray_rl.py on a local Ray instance, run as a user runs it (real actors, real sockets, CPU).

Each run gets its own Ray temp folder and a tag in its environment, which every process Ray starts
for it inherits; after the run no process may carry the tag (raylet, GCS, workers: all gone).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]'; scripts/setup.sh installs it)")

# (one test process runs them all, one after another, when the suite runs in several (make test): the
# module's Ray set-up, ~7 processes, is then made once and never beside another Ray run on a small machine)
pytestmark = [pytest.mark.timeout(200), pytest.mark.xdist_group("ray")]

ROOT = Path(__file__).resolve().parent.parent
TAG = "RAY_RL_TEST_TAG"


def _tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment holds ``TAG=tag``."""
    want = f"{TAG}={tag}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if want in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def _run(tmp_path: Path, *args: str, timeout: float = 120,
         on_line: Callable[[str, dict[str, int], str], None] | None = None,
         terminate_at: Callable[[str], bool] | None = None) -> tuple[int, str, str, dict]:
    """Run the example; return (exit code, stdout, stderr, summary). Asserts that nothing it started is left.

    ``on_line(line, pids, tag)`` sees each stdout line as it comes (``pids``: the actors' pids by name, from the
    example's ``pids:`` line); what it raises is re-raised once the run is cleaned up. The example is sent
    SIGTERM (as a job scheduler stops it) at the first line for which ``terminate_at(line)`` is true."""
    tag = uuid.uuid4().hex
    temp_dir = tempfile.mkdtemp(prefix="rayrl-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    env = dict(os.environ, **{TAG: tag, "TRANSPORT_FR_DIR": str(tmp_path / "fr")})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    err_path = tmp_path / f"stderr-{tag}.txt"
    lines: list[str] = []
    pids: dict[str, int] = {}
    failure: list[BaseException] = []
    timed_out = threading.Event()
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen([sys.executable, "examples/ray_rl.py", "--ray-temp-dir", temp_dir, *args], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=err_file, text=True)

    def expire() -> None:  # SIGTERM first: the example shuts Ray down on it
        timed_out.set()
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
            return
        proc.kill()

    timer = threading.Timer(timeout, expire)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("pids: "):
                pids.update((n, int(p)) for n, p in (e.split() for e in line.removeprefix("pids: ").split(", ")))
            if terminate_at is not None and terminate_at(line):
                terminate_at = None
                proc.send_signal(signal.SIGTERM)
            if on_line is not None and not failure:
                try:
                    on_line(line, pids, tag)
                except BaseException as exc:  # noqa: BLE001 - re-raised below, after the clean-up
                    failure.append(exc)
        proc.wait(30)
        timer.cancel()
        out, err = "".join(lines), err_path.read_text()
        if timed_out.is_set():
            pytest.fail(f"the example ran past {timeout} s:\n{out}\n{err}")
        deadline = time.monotonic() + 15  # Ray's processes exit within moments of ray.shutdown()
        while (left := _tagged(tag)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"processes left behind by the run: {left}\n{out}\n{err}"
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
        for pid in _tagged(tag):  # (only after a failed check above) ours: they carry this run's tag
            for sig in (signal.SIGCONT, signal.SIGKILL):  # SIGCONT: one the test stopped must not linger
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        shutil.rmtree(temp_dir, ignore_errors=True)
    if failure:
        raise failure[0]
    summary_lines = [ln for ln in out.splitlines() if ln.startswith("summary: ")]
    summary = json.loads(summary_lines[-1].removeprefix("summary: ")) if summary_lines else {}
    return proc.returncode, out, err, summary


def test_every_generator_samples_with_every_version(tmp_path):
    steps = 3
    rc, out, err, s = _run(tmp_path, "--generators", "2", "--steps", str(steps))
    assert rc == 0, out + err
    names = ["gen-0", "gen-1"]
    assert s["generators"] == names and s["killed"] is None, out
    # on-policy: at step k every generator sampled with version k, the newest the trainer had pushed
    assert s["sampled"] == {n: list(range(1, steps + 1)) for n in names}, out
    assert [p["version"] for p in s["pushes"]] == list(range(1, steps + 2)), out
    for p in s["pushes"]:
        assert p["ok"] and sorted(p["results"]) == names, out
        assert all(r["stage"] == "committed" and r["plane"] == "shm" for r in p["results"].values()), out
    assert s["verified"] == names and s["final_version"] == steps + 1, out
    assert s["bundles"] == 3 and s["strategy"] == "PACK", out
    assert len(set(s["nodes"].values())) == 1 and set(s["nodes"]) == {"trainer", *names}, out
    assert "verified: gen-0, gen-1 hold exactly the trainer's final weights" in out, out


def test_a_killed_generator_does_not_hold_up_the_others(tmp_path):
    steps, kill_at = 4, 2
    rc, out, err, s = _run(tmp_path, "--generators", "3", "--steps", str(steps), "--kill-at", str(kill_at))
    assert rc == 0, out + err
    alive, victim = ["gen-0", "gen-1"], "gen-2"
    assert s["killed"] == victim, out
    assert s["sampled"] == {**{n: list(range(1, steps + 1)) for n in alive}, victim: list(range(1, kill_at + 1))}, out
    pushes = {p["version"]: p for p in s["pushes"]}
    assert sorted(pushes) == list(range(1, steps + 2)), out
    for v in range(1, kill_at + 2):  # before the kill: everyone committed
        assert pushes[v]["ok"] and sorted(pushes[v]["results"]) == [*alive, victim], out
    hit = pushes[kill_at + 2]  # the first push after the kill: only the dead one's entry fails
    assert not hit["results"][victim]["ok"] and hit["results"][victim]["error"], out
    assert all(hit["results"][n]["ok"] for n in alive), out
    # not held up: a stall would run to the push's 60 s deadline; a push here takes milliseconds
    assert hit["seconds"] < 5 and all(hit["results"][n]["seconds"] < 5 for n in alive), out
    for v in range(kill_at + 3, steps + 2):  # afterwards the trainer has dropped it
        assert pushes[v]["ok"] and sorted(pushes[v]["results"]) == alive, out
    assert s["verified"] == alive and s["final_version"] == steps + 1, out


def test_sigterm_mid_run_exits_non_zero_and_leaves_no_process(tmp_path):
    """A job scheduler (Slurm, a Ray job stop) ends the example with SIGTERM mid-run: it must say so, exit non-zero
    and take Ray down with it (``_run`` checks that no process of the run is left: raylet, GCS, workers)."""
    t0 = time.monotonic()
    rc, out, err, s = _run(tmp_path, "--generators", "2", "--steps", "500",
                           terminate_at=lambda line: line.split()[:1] == ["2"])
    assert rc != 0 and "FAILED: signal SIGTERM" in err, out + err
    assert "verified:" not in out, out  # (stopped early: not a run to its end)
    assert time.monotonic() - t0 < 100, out + err


# ---------------------------------------------------------------------------- generators that die or freeze by themselves
# One run serves the tests below (each run of the example costs ~20-30 s of start-up on a 2-core machine). Of six
# generators, four fail, the driver's loop knowing nothing of it (it still asks them for rollouts and pushes to
# them), each at another point of a step:
# - gen-1's worker is SIGKILLed by the test once step 1 is printed: step 2's rollouts find it dead;
# - gen-2's worker is SIGSTOPped by the test once step 2 is printed: step 3's rollouts never come;
# - gen-3's worker is SIGKILLed (--fault) once step 3's rollouts are in, just before the push: the push finds it dead;
# - gen-4's worker is SIGSTOPped (--fault) once step 4's rollouts are in: the push gets no answer from it.
# gen-0 and gen-5 must get every version and end with the trainer's final weights.
FAULT_STEPS, STEP_TIMEOUT = 5, 6.0
DIES, FREEZES, DIES_IN_PUSH, FREEZES_IN_PUSH = "gen-1", "gen-2", "gen-3", "gen-4"
SURVIVORS = ["gen-0", "gen-5"]


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    events: dict[str, float | int] = {}

    def on_line(line: str, pids: dict[str, int], tag: str) -> None:
        step = line.split()[:1]
        for name, after, sig in ((DIES, "1", signal.SIGKILL), (FREEZES, "2", signal.SIGSTOP)):
            if step == [after] and name not in events:
                pid = pids[name]
                assert pid in _tagged(tag), f"{name}'s pid {pid} is not a process of this run"
                os.kill(pid, sig)
                events[name] = time.monotonic()
        if line.startswith("  sent SIGSTOP to "):
            events[line.split()[3]] = time.monotonic()
        events.update({f"{n}-pid": p for n, p in pids.items()})

    t0 = time.monotonic()
    rc, out, err, s = _run(tmp_path_factory.mktemp("faulty"), "--generators", "6", "--steps", str(FAULT_STEPS),
                           "--step-timeout", str(STEP_TIMEOUT), "--fault", f"{DIES_IN_PUSH}@3:KILL",
                           "--fault", f"{FREEZES_IN_PUSH}@4:STOP", on_line=on_line)
    events["end"] = time.monotonic()
    events["wall"] = events["end"] - t0
    return rc, out, err, s, events


def _lost(s: dict, name: str) -> dict:
    hits = [e for e in s.get("lost", []) if e["name"] == name]
    assert len(hits) == 1, s.get("lost")
    return hits[0]


def _check_run(faulty_run) -> tuple[str, dict]:
    """The checks every fault shares: the run succeeds, says nothing failed, the survivors got everything."""
    rc, out, err, s, events = faulty_run
    text = out + err
    assert rc == 0 and "verified:" in out, text
    assert "Traceback" not in err and "FAILED" not in text, text
    final = FAULT_STEPS + 1
    assert s["verified"] == SURVIVORS and s["final_version"] == final, out
    assert [e["name"] for e in s["lost"]] == [DIES, FREEZES, DIES_IN_PUSH, FREEZES_IN_PUSH], out
    assert {n: s["sampled"][n] for n in SURVIVORS} == {n: list(range(1, FAULT_STEPS + 1)) for n in SURVIVORS}, out
    assert [p["version"] for p in s["pushes"]] == list(range(1, final + 1)), out
    for p in s["pushes"]:  # every version reached every survivor
        assert all(p["results"][n]["ok"] for n in SURVIVORS), out
    # and they hold the trainer's final weights, byte for byte
    assert {n: s["held"][n] for n in SURVIVORS} == {n: [final, s["digest"]] for n in SURVIVORS}, out
    assert len(s["digest"]) == 64, out
    assert events["wall"] < 120, (events, out)
    return out, s


def _dropped_after(s: dict, name: str, step: int, out: str) -> None:
    """Pushes after ``step``'s leave ``name`` out (the trainer unsubscribed it), and its process is gone."""
    after = [p for p in s["pushes"] if p["version"] > step + 1]
    assert all(name not in p["results"] for p in after), out
    assert f"lost: {name} at step {step}" in out, out


def test_ray_example_survives_a_generator_that_dies_by_itself(faulty_run):
    """(Review finding 7.) A generator whose worker is SIGKILLed from outside mid-run is still asked for rollouts
    and still pushed to: its failure must cost only its own entry, with a line saying what happened, not crash
    the run with an uncaught ActorDiedError."""
    out, s = _check_run(faulty_run)
    assert DIES in faulty_run[4], out
    lost = _lost(s, DIES)  # killed once step 1 was printed: step 2's rollouts (or its push) find it dead
    assert lost["step"] == 2 and lost["phase"] in ("rollouts", "push") and "died" in lost["why"], lost
    assert s["sampled"][DIES] in ([1], [1, 2]), out
    _dropped_after(s, DIES, 2, out)


def test_ray_example_survives_a_generator_that_dies_mid_push(faulty_run):
    out, s = _check_run(faulty_run)
    lost = _lost(s, DIES_IN_PUSH)  # its rollouts of step 3 came (and were trained on), then it died
    assert lost == {**lost, "step": 3, "phase": "push"} and "died" in lost["why"], lost
    assert s["sampled"][DIES_IN_PUSH] == [1, 2, 3], out
    entry = s["pushes"][3]["results"][DIES_IN_PUSH]  # version 4: only its entry failed, and at once
    assert not entry["ok"] and entry["error"] and s["pushes"][3]["seconds"] < 5, out
    _dropped_after(s, DIES_IN_PUSH, 3, out)


def test_ray_example_drops_a_frozen_generator_within_the_step_timeout(faulty_run):
    """A generator SIGSTOPped mid-run never answers again: the step waits for its rollouts (or the push for its
    entry, then a ping) at most --step-timeout each, then it is dropped and killed; the others go on getting
    every version."""
    out, s = _check_run(faulty_run)
    events = faulty_run[4]
    lost = _lost(s, FREEZES)  # stopped once step 2 was printed: step 3's rollouts never come
    assert lost["step"] == 3 and lost["phase"] in ("rollouts", "push") and "frozen" in lost["why"], lost
    _dropped_after(s, FREEZES, 3, out)
    lost = _lost(s, FREEZES_IN_PUSH)  # stopped after its rollouts of step 4: the push of version 5 gets no answer
    assert lost == {**lost, "step": 4, "phase": "push"} and "frozen" in lost["why"], lost
    assert "TransportTimeoutError" in lost["why"] or "PeerLostError" in lost["why"], lost
    push = s["pushes"][4]  # version 5: only the frozen one's entry failed, bounded by the push's timeout
    assert not push["results"][FREEZES_IN_PUSH]["ok"] and push["seconds"] < STEP_TIMEOUT + 5, out
    _dropped_after(s, FREEZES_IN_PUSH, 4, out)
    # bounded: each freeze costs at most a step timeout for rollouts, or a push timeout then a 3 s ping
    assert events["end"] - events[FREEZES] < 2 * STEP_TIMEOUT + 5 + 30, (events, out)
    # the frozen processes themselves are gone (ray.kill; _run also checked no process of the run is left)
    for name in (FREEZES, FREEZES_IN_PUSH):
        assert not Path(f"/proc/{events[f'{name}-pid']}").exists(), out
