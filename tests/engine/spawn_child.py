"""multiprocessing's spawn context with its children forked from the zygote (tests/zygote.py), for
in-process ProcessEngines (tests/engine/conftest.py, `engine_core_forked`).

`python -m tests.engine.spawn_child --multiprocessing-fork tracker_fd=N pipe_handle=M` is what spawn
runs in a child (`python -c 'from multiprocessing.spawn import spawn_main; spawn_main(...)'
--multiprocessing-fork`), as a module the zygote can fork: spawn_main reads the preparation data and
the pickled process object from the pipe, prepares the main module as spawn does, runs the target
and exits with its exit code. `ZygoteSpawnProcess` lives here, not in a conftest, because the
process object is pickled with its class, which the child imports by name.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from multiprocessing import popen_spawn_posix, reduction, resource_tracker, spawn, util
from multiprocessing.connection import wait as connection_wait
from multiprocessing.context import SpawnProcess, set_spawning_popen
from typing import Any

from tests import zygote


class ZygoteSpawnPopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn Popen with its child forked from the zygote (tests/zygote.py): the
    stdlib's `_launch` line for line (the same pickled preparation data and process object on the
    same pipe, the same descriptors passed, the same sentinel) but for the start, which runs
    `spawn_main` as `python -m tests.engine.spawn_child` where spawn runs it with `-c`. The exit
    status comes from the zygote, the child's parent (`poll`)."""

    def _launch(self, process_obj: Any) -> None:
        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        prep_data = spawn.get_preparation_data(process_obj._name)
        buffer = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buffer)
            reduction.dump(process_obj, buffer)
        finally:
            set_spawning_popen(None)
        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            self._fds.extend([child_r, child_w])
            self._lock = threading.Lock()
            self._child = zygote.popen([sys.executable, "-m", "tests.engine.spawn_child", "--multiprocessing-fork",
                                        f"tracker_fd={tracker_fd}", f"pipe_handle={child_r}"],
                                       cwd=zygote.ROOT, pass_fds=self._fds)
            self.pid = self._child.pid
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as pipe:
                pipe.write(buffer.getbuffer())
        finally:
            self.finalizer = util.Finalize(self, util.close_fds, [fd for fd in (parent_r, parent_w) if fd is not None])
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        """As waitpid's: the exit status once the child has ended (its sentinel closed, the zygote's
        word then milliseconds away), else None unless `flag` asks to block. Locked: the handle's
        connection is read by one thread at a time (ProcessEngine's reader and its owner both join)."""
        if self.returncode is None:
            if flag != os.WNOHANG:
                connection_wait([self.sentinel])
            ended = bool(connection_wait([self.sentinel], 0))
            with self._lock:
                if self.returncode is None:
                    self.returncode = self._child.wait() if ended else self._child.poll()
        return self.returncode


class ZygoteSpawnProcess(SpawnProcess):
    """A spawn context's Process whose child the zygote forks (`ZygoteSpawnPopen`)."""

    @staticmethod
    def _Popen(process_obj: Any) -> ZygoteSpawnPopen:
        return ZygoteSpawnPopen(process_obj)


if __name__ == "__main__":
    # A spawned child's grammar pool starts its forker cold (test_grammar_pool.py reads it among the
    # engine-core child's own processes): the zygote's hook that forks it instead is left out here.
    sys.meta_path[:] = [finder for finder in sys.meta_path if not getattr(finder, "zygote_hook", False)]
    options = dict(argument.split("=", 1) for argument in sys.argv[2:])
    spawn.spawn_main(pipe_handle=int(options["pipe_handle"]), tracker_fd=int(options["tracker_fd"]))
