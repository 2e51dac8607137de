"""A process that forks children on request, each served by one function on the socket it was
sent: the grammar pool's compiling processes come from one (serving.engine.grammar_pool).

Why: a compiling process needs the grammar library, whose import brings torch and transformers
(1.5 s of CPU), and the tokenizer's table (seconds at a 128k vocabulary). Started cold, each
process paid both, and so did every replacement of one killed past its time, while the tenants
beside it shared the cores with that start. Forked from a process that holds both, a child is
ready in milliseconds and shares the table's pages with its siblings.

The protocol, on the control socket (multiprocessing.connection's framing):

    parent -> forker: ("spawn",) followed by one descriptor (multiprocessing.reduction.send_handle):
                      a child is forked and served on it;
                      ("kill", pid): SIGKILL to that child, if it is still one of this forker's.

The forker sends nothing back: a child introduces itself on its own socket. Kills go through the
forker because only it knows whether a pid is still its child (reaped, the number could be another
process's). It reaps its children as they end and says on stderr how one ended unexpectedly. It
ends when the control socket closes; its children die with it (each has the parent-death signal).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle, send_handle

# Linux's prctl option: the kernel sends this process a signal when its parent dies.
_PR_SET_PDEATHSIG = 1
# How often the loop reaps ended children while no message comes.
_REAP_INTERVAL_S = 0.2


def die_with_parent() -> None:
    """SIGKILL when this process's parent dies, even mid-compile (when no message can be read)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn(control: Connection, fd: int, forker_pid: int) -> None:
    """Ask the forker on ``control`` for a child served on ``fd`` (the caller then closes its copy)."""
    control.send(("spawn",))
    send_handle(control, fd, forker_pid)


def serve_forks(control: Connection, child: Callable[[Connection], None]) -> None:
    """Fork a child per request on ``control``, each running ``child`` on its socket; return when
    ``control`` closes."""
    me = os.getpid()
    children: set[int] = set()
    while True:
        if wait([control], _REAP_INTERVAL_S):
            try:
                message = control.recv()
            except (EOFError, OSError):
                return
            if message[0] == "spawn":
                fd = recv_handle(control)
                pid = os.fork()
                if pid == 0:
                    _run_child(control, fd, me, child)
                os.close(fd)
                children.add(pid)
            elif message[0] == "kill" and message[1] in children:
                os.kill(message[1], signal.SIGKILL)
        _reap(children)


def _run_child(control: Connection, fd: int, forker: int, child: Callable[[Connection], None]) -> NoReturn:
    """The forked child's whole life: it never returns into the forker's loop."""
    status = 0
    try:
        control.close()  # the parent sees the forker's end only once the forker itself is gone
        die_with_parent()
        if os.getppid() != forker:  # the forker died before the line above: nobody would kill this
            os._exit(1)
        child(Connection(fd))
    except BaseException:  # noqa: BLE001  # whatever it was, the child must end here, said on stderr
        traceback.print_exc()
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _reap(children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        # Killed by SIGKILL: the parent's kill (past its time, cancelled, closed); an exit of 0: its
        # socket closed. Anything else is a crash, which the parent sees only as a closed socket.
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0:
            print(f"forked process {pid} exited with status {os.WEXITSTATUS(status)}", file=sys.stderr, flush=True)
        elif os.WIFSIGNALED(status) and os.WTERMSIG(status) != signal.SIGKILL:
            print(f"forked process {pid} was killed by signal {os.WTERMSIG(status)}", file=sys.stderr, flush=True)
