"""Fixed ports, one user at a time, and processes that leave nothing listening behind them.

The documented commands name fixed ports (8000, 8001, 8002, 8080; Ray Serve's 8100). Two runs that name
one port must never overlap: not two threads of one pytest process, not two pytest-xdist workers, not two
pytest sessions on one machine. ``holding(ports)`` takes an exclusive ``flock`` on one file per port in a
folder every process on the machine shares (a lock taken by another ``open`` of the same file excludes,
whichever thread or process holds it, and the kernel drops it when its holder dies, so a crashed run
leaves no stale lock).

A run that fails must stop everything it started before the next run on its port begins. Killing the
process group of a command is not enough: a program may start helpers in sessions of their own
(``setsid``), which leave the group. ``kill_tree`` kills the group and every descendant found before the
kill, and ``wait_until_released`` waits until nothing listens on the port any more, or says which
process still does.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psutil

LOCK_DIR = Path(tempfile.gettempdir()) / "kvreuse-test-ports"
RELEASE_TIMEOUT_S = 30.0


@contextmanager
def holding(ports: Iterable[int], timeout_s: float = 1800.0) -> Iterator[None]:
    """Exclusive use of ``ports`` on this machine while the block runs (waits for other holders, in port
    order, so two callers that want overlapping sets never deadlock)."""
    LOCK_DIR.mkdir(exist_ok=True)
    with ExitStack() as stack:
        for port in sorted(set(ports)):
            handle = stack.enter_context(open(LOCK_DIR / f"{port}.lock", "a"))
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"port {port}: another run held it for {timeout_s:.0f} s") from None
                    time.sleep(0.1)
        yield


def free_port() -> int:
    """A port nothing listens on now (the kernel's choice from its ephemeral range, never a fixed one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) != errno.ECONNREFUSED


def listeners(port: int) -> list[psutil.Process]:
    """The processes with a socket listening on ``port`` (any local address)."""
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            try:
                found.append(psutil.Process(conn.pid))
            except psutil.NoSuchProcess:
                pass
    return found


def describe(process: psutil.Process) -> str:
    try:
        return f"pid {process.pid} ({' '.join(process.cmdline())[:200]})"
    except psutil.Error:
        return f"pid {process.pid}"


MARK = "KVREUSE_TEST_PROCESS"  # set in the environment of a process a test starts; its children inherit it


def marked(mark: str, variable: str = MARK) -> list[psutil.Process]:
    """The processes whose environment has ``variable=mark``: whatever a started command left, in any session."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(variable) == mark:
                found.append(process)
        except psutil.Error:
            pass
    return found


def kill_tree(pid: int, mark: str | None = None) -> None:
    """SIGKILL the process group led by ``pid``, every descendant of ``pid`` (found before anything is
    killed: an orphan is re-parented and no longer found) and, given ``mark``, every process whose
    environment carries it (what left the group and lost its parent too)."""
    try:
        doomed = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        doomed = []
    if mark is not None:
        doomed += [process for process in marked(mark) if process.pid != os.getpid()]
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    end(doomed)


def end(processes: list[psutil.Process], grace_s: float = 0.0) -> None:
    """SIGTERM ``processes`` and give them ``grace_s`` to exit (none: straight to SIGKILL), then SIGKILL the rest."""
    if grace_s > 0:
        for process in processes:
            try:
                process.terminate()
            except psutil.NoSuchProcess:
                pass
        _, processes = psutil.wait_procs(processes, timeout=grace_s)
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)


def wait_until_released(ports: Iterable[int], timeout_s: float = RELEASE_TIMEOUT_S) -> None:
    """Return once nothing listens on any of ``ports``; AssertionError naming the listener otherwise."""
    deadline = time.monotonic() + timeout_s
    for port in ports:
        while listening(port):
            if time.monotonic() > deadline:
                holders = ", ".join(describe(process) for process in listeners(port)) or "a process not visible here"
                raise AssertionError(f"port {port} is still in use {timeout_s:.0f} s after its run stopped: {holders}")
            time.sleep(0.1)


def assert_served_by(port: int, pid: int, mark: str | None, what: str) -> None:
    """AssertionError unless every process listening on ``port`` is ``pid``, one of its descendants or one
    carrying ``mark``: an answer on the port is then the started program's own, not a stray server's."""
    ours = {pid}
    try:
        ours |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        pass
    if mark is not None:
        ours |= {process.pid for process in marked(mark)}
    strangers = [process for process in listeners(port) if process.pid not in ours]
    if strangers:
        raise AssertionError(f"port {port} answers, but not (only) from {what}: "
                             + ", ".join(describe(process) for process in strangers))

