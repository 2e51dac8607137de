"""Engine suites' fixtures: tiny base models per architecture and PEFT-saved adapters on them.

Both are session-scoped and cached, so every suite shares one build per (arch, seed) and adapters
cost one PEFT save each.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from serving.engine import grammar_pool, process_engine
from serving.engine.distributed import driver
from serving.engine.tiny import ARCHS, build_tiny_model, save_random_peft_adapter
from tests import zygote
from tests.engine import spawn_child


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Torch on one thread for a module (opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`):
    tiny matmuls are slower with threads fighting over two shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rank_popen(args: Sequence[str], *, stdin: Any = None, **options: Any) -> Any:
    """The tensor-parallel driver's `subprocess.Popen` for the ranks an engine in this test process
    spawns: the same `python -m serving.engine.distributed.rank_worker`, environment and pickled
    arguments on its standard input (a pipe), forked from the zygote (tests/zygote.py) instead of
    started cold, 4 s of CPU a rank spent importing torch and transformers."""
    if stdin != subprocess.PIPE:
        return zygote.popen(args, stdin=stdin, **options)
    read, write = os.pipe()
    try:
        process = zygote.popen(args, stdin=read, **options)
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    process.stdin = os.fdopen(write, "wb")  # what the driver writes the rank's arguments to, then closes
    return process


@pytest.fixture
def tp_ranks_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor-parallel ranks of in-process engines forked from the zygote (opt in with
    `pytest.mark.usefixtures("tp_ranks_forked")`). The ranks' own code, its wire with rank 0 and their
    deaths are as when started cold; the serving worker's and the process engine's ranks, spawned by
    processes of their own, still start cold."""
    # A namespace of its own: patching the subprocess module itself would reach every caller's Popen.
    monkeypatch.setattr(driver, "subprocess", SimpleNamespace(Popen=_rank_popen, PIPE=subprocess.PIPE,
                                                              TimeoutExpired=subprocess.TimeoutExpired))


@pytest.fixture(scope="module")
def engine_core_forked() -> Iterator[None]:
    """ProcessEngine's engine-core child forked from the zygote (tests/engine/spawn_child.py), which
    has torch, transformers and the rest imported, instead of started cold by its spawn context, where each
    child spent about 4 s of CPU importing them (opt in with `pytest.mark.usefixtures(
    "engine_core_forked")`). To the child the two are alike: a fresh `multiprocessing` child that
    reads the same pickled process object and pipe from spawn's own `spawn_main`, its main module
    prepared as spawn prepares it, with default signal handlers and, as a cold child, its pool's
    grammar forker started cold (tests/engine/spawn_child.py); its pid, exit code, sentinel and
    kill are the parent's as before. It used to come from multiprocessing's fork server (2.2 s of
    CPU to start it, in each test process that ran a ProcessEngine test, and 0.45 s more of imports
    a child than the zygote's). The serving worker's engine process (test_engine_process_flag.py)
    still spawns."""
    context = SimpleNamespace(Process=spawn_child.ZygoteSpawnProcess,
                              Pipe=multiprocessing.get_context("spawn").Pipe)

    def get_context(method: str) -> Any:
        assert method == "spawn", f"ProcessEngine asks for {method!r} now: is the zygote's fork still alike?"
        return context

    # Module-scoped, for the modules' shared engines; a namespace of its own, not the module's attribute.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(process_engine, "multiprocessing", SimpleNamespace(get_context=get_context))
        yield


@pytest.fixture(scope="module", autouse=True)
def grammar_forker_forked() -> Iterator[None]:
    """Every in-process engine's grammar forker forked from the zygote (`zygote.grammar_forker_forked`;
    a serving worker forked from the zygote does the same for its own pool, tests/zygote.py). It runs
    the forker's own code, which forks the compiling processes, kills them, limits their memory and
    ends when its pool's socket closes, as when started cold; what differs is its parent, the zygote
    (it dies with it, not with the test process, and leaves with its socket anyway). Module-scoped
    and automatic: module-scoped engines start theirs in a module's set-up, and nothing of an in-process
    pool's tests reads its forker's parent. The pool's lifecycle with a cold forker stays tested by the
    stub pools (their command is no `-m`) and by ProcessEngine's engine-core child, whose pool is its
    own (test_grammar_pool.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grammar_pool, "subprocess", grammar_pool.subprocess)  # put back on leaving
        zygote.grammar_forker_forked(grammar_pool)
        yield


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`factory(arch="llama", seed=0)` → a tiny model directory, built once per session."""
    built: dict[tuple[str, int], Path] = {}

    def factory(arch: str = "llama", seed: int = 0) -> Path:
        if (arch, seed) not in built:
            out = tmp_path_factory.mktemp("models") / f"tiny-{arch}"
            built[arch, seed] = build_tiny_model(out, arch=arch, seed=seed)
        return built[arch, seed]

    return factory


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> Path:
    """A tiny model of each architecture in turn (tests using it run once per arch)."""
    return tiny_model_factory(request.param)


@pytest.fixture(scope="session")
def make_adapter(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`make_adapter(base_dir, r=8, lora_alpha=16, target_modules=(…), seed=0)` → new PEFT dir."""
    counter = itertools.count()

    def make(
        base_dir: Path,
        *,
        r: int = 8,
        lora_alpha: float = 16,
        target_modules: Sequence[str] = ("q_proj", "v_proj"),
        seed: int = 0,
        **kwargs: object,
    ) -> Path:
        out = tmp_path_factory.mktemp("adapters") / f"adapter-{next(counter)}"
        return save_random_peft_adapter(
            base_dir, out, r=r, lora_alpha=lora_alpha, target_modules=target_modules, seed=seed,
            **kwargs,
        )

    return make
