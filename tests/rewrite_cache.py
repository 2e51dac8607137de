"""The xdist controller rewrites the test modules' asserts once, while its workers start.

A pytest plugin (`-p tests.rewrite_cache` in pyproject's addopts). pytest compiles each test module
and conftest with its asserts rewritten and caches the result in `__pycache__/` (make test writes
bytecode, see the Makefile). In a fresh clone, as CI runs, no cache exists yet and each of the four
workers, which all collect every file at once, rewrote all ~270 modules itself: ~7 s of CPU each.
The controller, idle while its workers import torch and Django, now writes the cache first, by
pytest's own functions (those its import hook calls, mirrored from
`AssertionRewritingHook.exec_module`); a module a worker reaches before the controller is
rewritten by that worker as before (pytest writes each file atomically). With a warm cache this
reads each file and its cached hash and rewrites nothing.
"""

from __future__ import annotations

import fnmatch
import sys

import pytest
from _pytest.assertion.rewrite import (
    PYC_TAIL,
    _read_pyc,
    _rewrite_test,
    _write_pyc,
    assertstate_key,
    get_cache_dir,
    try_makedirs,
)


@pytest.hookimpl(trylast=True)  # after xdist's own sessionstart has started the workers
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    is_controller = bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")
    if not is_controller or sys.dont_write_bytecode or assertstate_key not in config.stash:
        return
    state = config.stash[assertstate_key]
    patterns = [*config.getini("python_files"), "conftest.py"]
    # The run's arguments (testpaths when none are given): a file, a folder, or a test's node id.
    places = [config.invocation_params.dir / arg.split("::")[0] for arg in config.args]
    files = {path for place in places for path in (place.rglob("*.py") if place.is_dir() else [place])}
    for path in sorted(files):
        if not path.is_file() or path.suffix != ".py" or not any(fnmatch.fnmatch(path.name, p) for p in patterns):
            continue
        cache_dir = get_cache_dir(path)
        pyc = cache_dir / (path.name[:-3] + PYC_TAIL)
        if _read_pyc(path, pyc, state.trace) is None and try_makedirs(cache_dir):
            source_hash, code = _rewrite_test(path, config)
            _write_pyc(state, code, source_hash, pyc)
