"""rl_sync across "hosts": network namespaces on a private bridge, a link cut in the middle of a push.

The trainer and three generators each run on a host of their own (``tests/_netns.py``: own
network, pid, mount and UTS namespaces, 10.231.0.0/24 on veths into one bridge; nothing in the
root namespace), so ``transport`` picks ``tcp`` as between machines. One generator's link is
taken down (``ip link set eth0 down`` in its namespace) while a push is running: only that
subscriber fails, within the heartbeat bound; the others commit the exact bytes; after the link
comes back the next push delivers everything to all three. The others commit without waiting
for the cut one to be given up on. Needs root (skipped otherwise).
"""

from __future__ import annotations

import json
import time

import pytest

from tests._netns import Hosts, clean_stale, unavailable
from tests._netns_gen import digest, weights

# 96 MiB: 12 buckets of 8 MiB, so a push over tcp is long enough to be cut in the middle
SPEC = {
    "embed.weight": ("float32", (4096, 4096)),
    "layers.0.weight": ("float32", (2048, 2048)),
    "layers.1.weight": ("bfloat16", (4096, 2048)),
    "layers.1.bias": ("float32", (4096,)),
    "steps": ("int64", (3,)),
}
BUCKET = 8 << 20
HB = 2.5  # heartbeat_timeout of every endpoint here (interval HB / 4)
SLACK = 6.0  # a 2-core machine shared with other test runs: detection bounds are generous


@pytest.fixture
def hosts(request):
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    stale = clean_stale()
    if stale:
        print(f"\nremoved network namespaces of earlier crashed runs: {stale}")
    h = Hosts(4)
    request.addfinalizer(h.close)  # whatever happens from here, every namespace and process goes
    return h.up()


class _Expected:
    """sha256 of each version's weights, computed here from the version (the trainer makes them alike)."""

    def __init__(self) -> None:
        self._known: dict[int, str] = {}

    def __getitem__(self, version: int) -> str:
        if version not in self._known:
            self._known[version] = digest(weights(SPEC, version))
        return self._known[version]


def _start(hosts: Hosts, tmp_path):
    spec = json.dumps(SPEC)
    trainer = hosts.spawn(0, "_netns_trainer.py", "--name", "trainer", "--addr", hosts.addr(0), "--spec", spec,
                          "--heartbeat-timeout", str(HB), "--bucket-bytes", str(BUCKET), hostname="host0",
                          log_dir=tmp_path, name="trainer")
    store = trainer.wait_ready()["store_url"]
    assert store.startswith(f"tcp://{hosts.addr(0)}:"), store
    gens = {}
    for i in (1, 2, 3):
        name = f"gen{i}"
        gens[name] = hosts.spawn(i, "_netns_gen.py", "--name", name, "--store", store, "--spec", spec,
                                 "--heartbeat-timeout", str(HB), hostname=f"host{i}", log_dir=tmp_path, name=name)
    for g in gens.values():
        info = g.wait_ready()
        assert info["address"][0] == hosts.addr(int(g.name[-1])), info
    return trainer, gens


def _push(trainer, names, version, timeout=60.0):
    trainer.call("push_start", subscribers=names, version=version, timeout=timeout)
    return trainer.call("push_result", wait=timeout + 30, timeout=timeout + 20)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["link", "netem"])
def test_a_cut_link_fails_only_that_subscriber_and_the_next_push_delivers_everything(hosts, tmp_path, how):
    """``how``: ``link`` takes the victim's eth0 down; ``netem`` drops everything it sends (100% loss)."""
    if how == "netem" and (reason := hosts.netem_unavailable(2)) is not None:
        pytest.skip(reason)
    trainer, gens = _start(hosts, tmp_path)
    names = sorted(gens)
    want = _Expected()
    reads = 0

    def read(g):  # the version a generator holds and its weights' sha256, read under hold()
        nonlocal reads
        reads += 1
        return g.call("state")

    try:
        planes = trainer.call("connect", names=names)
        for n in names:
            assert planes[n]["plane"] == "tcp", planes
            assert "pid namespaces" in planes[n]["reason"], planes
        rep = _push(trainer, names, 1)
        assert all(r["ok"] for r in rep["results"].values()), rep["summary"]
        mib = sum(r["bytes"] for r in rep["results"].values()) / 2**20
        print(f"\npush v1 to 3 hosts over tcp: {mib:.0f} MiB in {rep['seconds']:.2f} s; planes: "
              + ", ".join(f"{n}: {p['plane']} ({p['reason']})" for n, p in planes.items()))
        for n, g in gens.items():
            st = read(g)
            assert st["version"] == 1 and st["sha256"] == want[1], (n, st)
            assert g.call("peers")["trainer"]["plane"] == "tcp"
            assert g.call("peers")["trainer"]["socket"] == "tcp"  # (another pid namespace: no Unix socket tried)

        victim_name = "gen2"
        victim, victim_host = gens[victim_name], 2
        others = [n for n in names if n != victim_name]
        version, outcome = 1, None
        for _attempt in range(3):  # a push that finishes before the cut lands is repeated
            version += 1
            t0 = trainer.call("push_start", subscribers=names, version=version, timeout=60.0)
            seen: dict = {"counts": {}, "done": False}
            until = time.monotonic() + 5.0
            while time.monotonic() < until:
                seen = trainer.call("progress", wait=10)
                if seen["done"] or seen["counts"].get(victim_name, 0) >= 1:
                    break
                time.sleep(0.002)
            cut_at = time.monotonic()
            hosts.cut(victim_host, how)
            rep = trainer.call("push_result", wait=90, timeout=80)
            res = rep["results"]
            if res[victim_name]["ok"]:  # the push was over before the link went down
                print(f"push v{version} ended before the cut (pulls served {seen['counts']}); again")
                assert all(r["ok"] for r in res.values()), rep["summary"]
                _wait_for_peer(victim, present=False, within=3 * HB + SLACK)
                hosts.restore(victim_host, how)
                continue
            outcome = "during" if seen["counts"].get(victim_name, 0) >= 1 else "before its first pull"
            break
        assert outcome is not None, "three pushes in a row ended before the link could be cut"
        failed_at = rep["t0"] + res[victim_name]["seconds"]
        detection = failed_at - cut_at
        print(f"push v{version}: {victim_name}'s link cut ({how}) {cut_at - t0:.3f} s into the push ({outcome}; pulls "
              f"served by then: {seen['counts']}); {victim_name} failed with {res[victim_name]['error_type']} "
              f"{detection:.2f} s after the cut (heartbeat_timeout {HB} s); push took {rep['seconds']:.2f} s: "
              f"{rep['summary']}; the others committed at "
              + ", ".join(f"{n} {res[n]['seconds']:.2f} s" for n in others))
        assert [n for n, r in res.items() if not r["ok"]] == [victim_name], rep["summary"]
        assert res[victim_name]["error_type"] in ("PeerLostError", "TransportTimeoutError"), rep["summary"]
        assert detection < HB + HB / 4 + SLACK, f"{victim_name} was given up on {detection:.2f} s after the cut"
        assert rep["seconds"] < 60, "the push ran to its deadline: the cut subscriber was not detected"
        late = {n: res[n]["seconds"] for n in others if rep["t0"] + res[n]["seconds"] >= failed_at}
        assert not late, f"the others waited for the cut subscriber to be given up on: committed at {late}"
        for n in others:
            st = read(gens[n])
            assert st["version"] == version and st["sha256"] == want[version], (n, st)
        st = read(victim)  # its control pipe still works: its weights stayed at the last commit
        assert st["version"] == version - 1 and st["sha256"] == want[version - 1] and not st["torn"], st

        # the victim notices too (its own heartbeats), then the link comes back
        _wait_for_peer(victim, present=False, within=3 * HB + SLACK)
        down_for = time.monotonic() - cut_at
        hosts.restore(victim_host, how)
        assert hosts.link_state(victim_host) == "UP", hosts.link_state(victim_host)
        version += 1  # no help: the push itself dials the victim again
        rep = _push(trainer, names, version)
        assert all(r["ok"] for r in rep["results"].values()), rep["summary"]
        for n, g in gens.items():
            st = read(g)
            assert st["version"] == version and st["sha256"] == want[version], (n, st)
        print(f"link restored after {down_for:.1f} s down; push v{version} delivered to 3/3, bit-exact "
              f"(sha256 {want[version][:12]}), in {rep['seconds']:.2f} s; figures: faults survived 1/1, "
              f"detection {detection:.2f} s; {reads} state reads under hold(), each the exact bytes of its version")
    except BaseException:
        for p in [trainer, *gens.values()]:
            print(f"--- {p.name} log tail:\n{p.log_tail(3000)}")
        raise


def _wait_for_peer(proc, *, present: bool, within: float, peer: str = "trainer") -> None:
    end = time.monotonic() + within
    while (peer in proc.call("peers", wait=10)) != present:
        assert time.monotonic() < end, f"{proc.name}: channel to {peer} still {'absent' if present else 'open'}"
        time.sleep(0.1)



def test_leftovers_of_a_crashed_run_are_removed():
    """A namespace named after a pytest process that is gone is removed; a live run's is kept."""
    import os
    import subprocess
    import sys

    from tests._netns import PREFIX, ip

    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True, timeout=30).stdout)
    stale, live = f"{PREFIX}{dead}-0-sw", f"{PREFIX}{os.getpid()}-999-sw"
    ip("netns", "add", stale)
    ip("netns", "add", live)
    try:
        assert stale in clean_stale()
        listed = ip("netns", "list").stdout
        assert stale not in listed and live in listed
    finally:
        ip("netns", "del", stale, check=False)
        ip("netns", "del", live, check=False)
