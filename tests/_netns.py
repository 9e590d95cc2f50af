"""Several "hosts" on one machine: network namespaces on a private bridge, made and removed by the tests.

Layout (nothing is added to the root namespace: no interface, address or route)::

    <prefix>-sw          a "switch" namespace holding bridge br0
    <prefix>-h<i>        one namespace per host: lo up, eth0 = 10.231.0.<i+1>/24
                         (eth0's veth peer p<i> lives in the switch namespace, on br0)

``10.231.0.0/24`` exists only on these veths; nothing routes it anywhere, so
all traffic stays between the namespaces (and their loopbacks). A process
started on a host (:meth:`Hosts.spawn`) runs in that network namespace and in
new pid, mount and UTS namespaces (``ip netns exec NS unshare --pid --fork
--mount-proc --uts --kill-child ...``): ``transport`` then sees another host
(same boot id, another pid namespace) and picks ``tcp``.

Namespace names carry the pytest process's pid (``rlnt<pid>-<k>-...``), so
concurrent runs never collide; :func:`clean_stale` removes those of runs
whose process is gone (a crashed run), and :meth:`Hosts.close` removes ours
whatever happened.

The spawned processes speak JSON lines with the test over their stdin/stdout
(pipes, not sockets: the test process stays in the root namespace and uses
no network at all): :class:`HostProc` on the test side, :class:`Control` in
the child. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

PREFIX = "rlnt"
SUBNET = "10.231.0"  # /24, only inside the test's namespaces
REPO = Path(__file__).resolve().parents[1]
_seq = itertools.count()
_NAME = re.compile(rf"^{PREFIX}(\d+)-")


def ip(*args: str, timeout: float = 15.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip ARGS`` (bounded); raises RuntimeError with its stderr when ``check`` and it fails."""
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: rc {res.returncode}: {res.stderr.strip()}")
    return res


def _netns_names() -> list[str]:
    res = ip("netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(ns: str) -> None:
    res = ip("netns", "pids", ns, check=False)
    for tok in res.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError):
            pass


def clean_stale() -> list[str]:
    """Remove this helper's namespaces left by runs whose pytest process is gone; returns their names."""
    gone = []
    for ns in _netns_names():
        m = _NAME.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            _kill_netns_pids(ns)  # processes a crashed run left in it (its own test children)
            ip("netns", "del", ns, check=False)
            gone.append(ns)
    return gone


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (a reason to skip), or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return f"needs root to make network namespaces (ip netns add); this runs as uid {os.geteuid()}"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool!r} (iproute2 / util-linux) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe{next(_seq)}"
    try:
        res = ip("netns", "add", probe, check=False)
        if res.returncode != 0:
            return f"'ip netns add' fails here: {res.stderr.strip()}"
        res = ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if res.returncode != 0:
            return f"cannot make a bridge inside a network namespace: {res.stderr.strip()}"
        cmd = ["ip", "netns", "exec", probe, "unshare", "--pid", "--fork", "--mount-proc", "--uts", "--kill-child",
               "true"]
        res2 = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
        if res2.returncode != 0:
            return f"cannot make pid/mount/uts namespaces (unshare): {res2.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"network namespaces unavailable: {exc}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """``n`` hosts on one switch. ``addr(i)`` is host i's address; ``spawn(i, ...)`` starts a process there."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = f"{PREFIX}{os.getpid()}-{next(_seq)}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [f"{self.tag}-h{i}" for i in range(n)]
        self.procs: list[HostProc] = []
        self.made: list[str] = []

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def up(self) -> Hosts:
        ip("netns", "add", self.switch)
        self.made.append(self.switch)
        sw = ("-n", self.switch)
        ip(*sw, "link", "set", "lo", "up")
        ip(*sw, "link", "add", "br0", "type", "bridge")
        ip(*sw, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ip("netns", "add", host)
            self.made.append(host)
            h = ("-n", host)
            ip(*h, "link", "set", "lo", "up")
            # made inside the switch namespace, one end moved straight into the host's: the root
            # namespace never holds either end
            ip(*sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", host)
            ip(*sw, "link", "set", f"p{i}", "master", "br0")
            ip(*sw, "link", "set", f"p{i}", "up")
            ip(*h, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            ip(*h, "link", "set", "eth0", "up")
        return self

    def exec(self, i: int, *argv: str, timeout: float = 15.0) -> subprocess.CompletedProcess[str]:
        """Run a short command in host i's network namespace (bounded)."""
        return subprocess.run(["ip", "netns", "exec", self.hosts[i], *argv], capture_output=True, text=True,
                              timeout=timeout)

    def cut(self, i: int, how: str = "link") -> None:
        """Cut host i off, from inside its namespace: ``"link"`` takes eth0 down; ``"netem"`` keeps it up
        and drops every packet it sends (``tc qdisc ... netem loss 100%``)."""
        if how == "link":
            ip("-n", self.hosts[i], "link", "set", "eth0", "down")
        elif how == "netem":
            res = self.exec(i, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "loss", "100%")
            if res.returncode != 0:
                raise RuntimeError(f"tc netem: {res.stderr.strip()}")
        else:
            raise ValueError(how)

    def restore(self, i: int, how: str = "link") -> None:
        if how == "link":
            ip("-n", self.hosts[i], "link", "set", "eth0", "up")
        else:
            res = self.exec(i, "tc", "qdisc", "del", "dev", "eth0", "root")
            if res.returncode != 0:
                raise RuntimeError(f"tc qdisc del: {res.stderr.strip()}")

    def netem_unavailable(self, i: int) -> str | None:
        """Why ``tc netem`` cannot be used on host i's link (a reason to skip), or None."""
        if shutil.which("tc") is None:
            return "'tc' (iproute2) is not installed"
        res = self.exec(i, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "1ms")
        if res.returncode != 0:
            return f"tc netem is not available in this kernel: {res.stderr.strip()}"
        self.exec(i, "tc", "qdisc", "del", "dev", "eth0", "root")
        return None

    def link_state(self, i: int) -> str:
        out = ip("-n", self.hosts[i], "-o", "link", "show", "eth0").stdout
        m = re.search(r"state (\S+)", out)
        return m.group(1) if m else out.strip()

    def spawn(self, i: int, script: str, *args: str, hostname: str, log_dir: Path, name: str) -> HostProc:
        """Start ``python script args`` on host i (its own network, pid, mount and UTS namespaces)."""
        log_path = log_dir / f"{name}.log"
        argv = ["ip", "netns", "exec", self.hosts[i], "unshare", "--pid", "--fork", "--mount-proc", "--uts",
                "--kill-child", sys.executable, str(REPO / "tests" / script), "--hostname", hostname, *args]
        proc = HostProc(argv, name, log_path)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        for ns in reversed(self.made):
            _kill_netns_pids(ns)
            ip("netns", "del", ns, check=False)
        left = [ns for ns in _netns_names() if ns.startswith(self.tag + "-")]
        self.made = []
        assert not left, f"network namespaces left behind: {left}"


class RemoteFailure(Exception):
    pass


class HostProc:
    """A child process driven by JSON lines over its stdin/stdout; its stderr goes to a log file."""

    def __init__(self, argv: list[str], name: str, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in kill()
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     bufsize=0, env=env, cwd=str(REPO))
        self._buf = b""
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._ids = itertools.count(1)
        self._early: dict[int, dict] = {}

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def _line(self, deadline: float) -> dict:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sel.select(left):
                raise TimeoutError(f"{self.name}: no reply in time\n--- its log:\n{self.log_tail()}")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)  # type: ignore[union-attr]
            if not chunk:
                raise RemoteFailure(f"{self.name} exited (rc {self.proc.poll()})\n--- its log:\n{self.log_tail()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def wait_ready(self, timeout: float = 90.0) -> dict:
        msg = self._line(time.monotonic() + timeout)
        if msg.get("id") != 0:
            raise RemoteFailure(f"{self.name}: expected its ready line, got {msg}")
        if "error" in msg:
            raise RemoteFailure(f"{self.name} failed to start: {msg['error']}\n{self.log_tail()}")
        return msg["result"]

    def send(self, cmd: str, **args: Any) -> int:
        rid = next(self._ids)
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"id": rid, "cmd": cmd, "args": args}) + "\n").encode())
        return rid

    def reply(self, rid: int, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while rid not in self._early:
            msg = self._line(deadline)
            self._early[msg.get("id", -1)] = msg
        msg = self._early.pop(rid)
        if "error" in msg:
            raise RemoteFailure(f"{self.name}: {msg['error']}")
        return msg["result"]

    def call(self, cmd: str, wait: float = 60.0, **args: Any) -> Any:
        """Send ``cmd`` with ``args`` and wait up to ``wait`` s for its reply."""
        return self.reply(self.send(cmd, **args), wait)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with _suppress():
                self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()  # unshare --kill-child: the python in the namespaces gets SIGKILL too
        with _suppress():
            self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            with _suppress():
                f.close()  # type: ignore[union-attr]
        with _suppress():
            self._sel.close()
        self._log.close()


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], (OSError, ValueError, subprocess.TimeoutExpired))


# ---------------------------------------------------------------------------- child side
class Control:
    """The child's end: commands arrive as JSON lines on stdin, replies leave on the original stdout
    (stdout itself is pointed at stderr, so nothing else can garble the replies). EOF on stdin
    (the test is gone) stops the child."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self._lock = threading.Lock()
        self.eof = threading.Event()

    def send(self, rid: int, *, result: Any = None, error: str | None = None) -> None:
        msg: dict[str, Any] = {"id": rid}
        if error is not None:
            msg["error"] = error
        else:
            msg["result"] = result
        with self._lock:
            self._out.write(json.dumps(msg) + "\n")
            self._out.flush()

    async def serve(self, handle: Any) -> None:
        """Run ``await handle(cmd, args)`` for every command, concurrently, replying to each; returns at EOF
        or after a ``stop`` command."""
        import traceback

        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[dict | None] = asyncio.Queue()

        def read() -> None:
            for line in sys.stdin.buffer:
                loop.call_soon_threadsafe(inbox.put_nowait, json.loads(line))
            self.eof.set()
            loop.call_soon_threadsafe(inbox.put_nowait, None)

        threading.Thread(target=read, name="control-in", daemon=True).start()
        tasks: set[asyncio.Task] = set()

        async def one(msg: dict) -> None:
            try:
                self.send(msg["id"], result=await handle(msg["cmd"], msg.get("args", {})))
            except BaseException as exc:  # reported to the test
                self.send(msg["id"], error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                if not isinstance(exc, Exception):
                    raise

        while True:
            msg = await inbox.get()
            if msg is None or msg["cmd"] == "stop":
                break
            t = asyncio.ensure_future(one(msg))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        for t in tasks:
            t.cancel()


def child_setup() -> tuple[Control, dict[str, str]]:
    """In a child: take over stdout, set the hostname given with ``--hostname`` (own UTS namespace),
    and return the ``--key value`` arguments."""
    args: dict[str, str] = {}
    argv = sys.argv[1:]
    for k, v in zip(argv[::2], argv[1::2], strict=True):
        args[k.removeprefix("--")] = v
    ctl = Control()
    if args.get("hostname"):
        import socket

        socket.sethostname(args["hostname"])
    return ctl, args
