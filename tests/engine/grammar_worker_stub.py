"""A stand-in for serving.engine.grammar_worker that speaks its protocol and nothing else, so a test
of the pool (tests/engine/test_grammar_pool.py) decides when a process is ready and how a compile
ends: ``python grammar_worker_stub.py DIR FD``. Like the real one it forks its compiling processes
(serving.engine.forker); it imports no grammar library.

- A forked process is ready at once, unless ``DIR/hold`` exists: then only once it is gone (a
  process's start that takes as long as the test wants); ready, it leaves ``DIR/ready-<pid>``.
- A compile's text ``hang``: never answers (the pool kills it past its time or on cancel);
  ``crash``: the process exits (a crash on its task); ``stall``: answers as below once
  ``DIR/stall`` is gone (a compile under way while the test does something to its process); anything
  else: an error answer naming it, at once (the pool settles the future without reading a compiled
  grammar back).
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

from serving.engine.forker import die_with_parent, serve_forks


def compile_loop(gate: Path, conn: Connection) -> None:
    while (gate / "hold").exists():
        time.sleep(0.01)
    (gate / f"ready-{os.getpid()}").touch()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            _, task_id, _, text = conn.recv()
        except EOFError:
            return
        if text == "hang":
            time.sleep(3600)
        if text == "crash":
            os._exit(3)
        while text == "stall" and (gate / "stall").exists():
            time.sleep(0.01)
        conn.send(("error", task_id, False, f"stub compiled {text}"))


def main() -> None:
    die_with_parent()
    gate, control = Path(sys.argv[1]), Connection(int(sys.argv[2]))
    control.recv()  # ("init", tokenizer table path, limits)
    serve_forks(control, lambda conn: compile_loop(gate, conn))


if __name__ == "__main__":
    main()
