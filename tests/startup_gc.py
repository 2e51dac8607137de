"""No cyclic garbage collection while a test process starts and collects; what it then holds is frozen.

A pytest plugin (`-p tests.startup_gc`, first in pyproject's addopts, so it is imported before the
other plugins, the conftests and the test modules, whose imports are the start's work). Starting
and collecting the suite leaves about 820,000 objects tracked (torch, transformers, Django, the
test modules), and Python's collector walked them again and again as they were made: about 2.3 s
of a process's ~13 s of CPU to collect the suite, paid by every xdist worker and the controller.
Nothing made then is garbage worth looking for (modules, classes, functions, parametrize ids).

So the collector is off until collection ends (on the xdist controller, which collects nothing,
until its collection hook returns); then one full collection frees what cycles there were, and
`gc.freeze()` moves the survivors out of the collector's generations, as serving's own processes
do once loaded (serving.engine.server.worker): a later full collection walks what the tests make,
not the imports again. What a test makes is collected as before. At exit they are handed back, so
the interpreter's last collection frees them as it would have (kept frozen, Triton's bindings
reported hundreds of leaked objects on every process's exit); not at pytest_unconfigure, where
pytest's own last collection would walk them all once more.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Generator

import pytest

gc.disable()
atexit.register(gc.unfreeze)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Generator[None, object, object]:
    try:
        return (yield)
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()
