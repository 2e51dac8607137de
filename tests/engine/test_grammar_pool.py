"""Grammar compilation as a shared resource with a per-tenant share (issue 37, item 2;
serving.engine.grammar_pool, serving.engine.guided): the queue is fair between tenants, a
constraint past the compile budget is refused (and a compile past its time is killed), a compile
nobody waits for is cancelled and its process killed, compiled grammars are cached per tenant, and
tenant B's new small schema is served while tenant A's pathological one still compiles.

No durations are asserted: waits poll for a condition (with a generous guard), and "B is not held
behind A" is an ordering: B's request ends while A's compile is still running."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import psutil
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from serving.engine import LLM, SamplingParams
from serving.engine.grammar_pool import FairQueue, GrammarBudget, GrammarPool, GrammarTooComplex
from serving.engine.guided import (
    GrammarCompiler,
    GrammarError,
    GuidedDecodingParams,
    TenantGrammarCache,
    grammar_tenant,
)

pytestmark = pytest.mark.e2e

SMALL = GuidedDecodingParams(json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
# Generous: only a guard against a hung test, never what a test checks.
GUARD_S = 300.0


def nested(depth: int) -> dict[str, Any]:
    """The attack's schema: objects nested `depth` schema levels (2 × depth JSON levels); xgrammar's
    conversion of it is superlinear in depth (300 levels: seconds; 400, the attack's: 18 s here, 39 s on its host)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HUGE = GuidedDecodingParams(json=nested(400))
# A budget that lets the huge schema in, so it compiles for long (the time budget is tested apart).
PERMISSIVE = GrammarBudget(timeout=600.0, workers=2, max_schema_depth=10_000)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture
def make_compiler(tokenizer: PreTrainedTokenizerBase) -> Iterator[Callable[[GrammarBudget], GrammarCompiler]]:
    made: list[GrammarCompiler] = []

    def make(budget: GrammarBudget) -> GrammarCompiler:
        made.append(GrammarCompiler(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id],
                                    budget=budget))
        return made[-1]

    yield make
    for compiler in made:
        compiler.shutdown()


# ---- the fair queue (deterministic) ------------------------------------------------------------


def test_a_tenant_never_waits_behind_another_tenants_queue() -> None:
    queue: FairQueue[str] = FairQueue(share=2)
    for i in range(5):
        queue.push("A", f"a{i}")
    queue.push("B", "b0")
    queue.push("C", "c0")
    # A queued first and most, yet B and C each run after at most one of A's.
    assert [queue.pop() for _ in range(4)] == [("A", "a0"), ("B", "b0"), ("C", "c0"), ("A", "a1")]
    # A is at its share (2 running): the rest waits though it is the only tenant with work.
    assert queue.pop() is None
    queue.finished("A")
    assert queue.pop() == ("A", "a2")


def test_a_tenant_runs_at_most_its_share_so_a_worker_stays_free() -> None:
    budget = GrammarBudget(workers=2)
    assert budget.share == 1  # one worker fewer than the pool: one is left for the others
    queue: FairQueue[str] = FairQueue(share=budget.share)
    queue.push("A", "a0")
    queue.push("A", "a1")
    assert queue.pop() == ("A", "a0")
    assert queue.pop() is None  # A's second waits for its first, not for a free worker
    queue.push("B", "b0")
    assert queue.pop() == ("B", "b0")
    assert queue.remove("A", "a1") and not queue.remove("A", "a1")
    assert len(queue) == 0


# ---- the per-tenant cache ----------------------------------------------------------------------


def test_compiled_grammars_are_cached_per_tenant(make_compiler: Callable[[GrammarBudget], GrammarCompiler]) -> None:
    compiler = make_compiler(GrammarBudget())
    a = compiler.compile(SMALL, "salt:tenant-1")
    assert compiler.compile(SMALL, "salt:tenant-1") is a  # the tenant's own cache (or compile in flight)
    b = compiler.compile(SMALL, "salt:tenant-2")
    assert b is not a  # another tenant never gets (nor times) the first one's grammar
    a.result(timeout=GUARD_S), b.result(timeout=GUARD_S)
    wait_for(lambda: compiler.cached_keys("salt:tenant-1") == compiler.cached_keys("salt:tenant-2") != [],
             "both tenants' entries")
    assert compiler.cached_keys("salt:tenant-1")[0][0] == "json"


def test_the_cache_evicts_the_largest_holder_first() -> None:
    cache = TenantGrammarCache(entries=2, max_bytes=100)
    futures = {name: Future[Any]() for name in ("a1", "a2", "a3", "b1")}
    cache.put("A", ("json", "a1"), futures["a1"])
    cache.put("A", ("json", "a2"), futures["a2"])
    cache.put("A", ("json", "a3"), futures["a3"])  # past A's 2 entries: A's oldest goes
    assert cache.keys("A") == [("json", "a2"), ("json", "a3")]
    cache.put("B", ("json", "b1"), futures["b1"])
    cache.settled("B", ("json", "b1"), futures["b1"], 30)
    cache.settled("A", ("json", "a2"), futures["a2"], 40)
    cache.settled("A", ("json", "a3"), futures["a3"], 40)  # 110 bytes in all: A holds the most
    assert cache.keys("A") == [("json", "a3")] and cache.keys("B") == [("json", "b1")]


def test_the_tenant_of_a_request() -> None:
    assert grammar_tenant("tenant-7", "acme/bot@1.0.0") == "salt:tenant-7"  # the gateway's salt first
    assert grammar_tenant(None, "acme/bot@1.0.0") == "tenant:acme"
    assert grammar_tenant(None, None) == grammar_tenant(None, "local-adapter") == "local"


# ---- the budget ---------------------------------------------------------------------------------


def test_a_schema_past_the_nesting_budget_is_refused_before_it_is_queued(
    make_compiler: Callable[[GrammarBudget], GrammarCompiler],
) -> None:
    compiler = make_compiler(GrammarBudget())
    refused = compiler.compile(HUGE, "salt:tenant-1")
    assert refused.done()  # at once: nothing was queued
    error = refused.exception()
    assert isinstance(error, GrammarTooComplex) and error.code == "grammar_too_complex"
    assert "nests 801 levels" in str(error)
    assert compiler.pool.running_pids() == []


def test_a_compile_past_its_time_is_killed_and_refused(make_compiler: Callable[[GrammarBudget], GrammarCompiler]) -> None:
    compiler = make_compiler(GrammarBudget(timeout=0.5, workers=2, max_schema_depth=10_000))
    future = compiler.compile(HUGE, "salt:tenant-1")
    wait_for(lambda: bool(compiler.pool.running_pids()) or future.done(), "the compile to start")
    pids = compiler.pool.running_pids()
    with pytest.raises(GrammarTooComplex, match="took longer than this worker's budget of 0.5 s"):
        future.result(timeout=GUARD_S)
    wait_for(lambda: all(gone(pid) for pid in pids), "the compiling process to be killed")
    # The pool goes on: the tenant's next (small) schema compiles.
    assert compiler.compile(SMALL, "salt:tenant-1").result(timeout=GUARD_S) is not None


def test_an_empty_language_is_a_grammar_error_not_a_crash(make_compiler: Callable[[GrammarBudget], GrammarCompiler]) -> None:
    compiler = make_compiler(GrammarBudget())
    with pytest.raises(GrammarError, match="matches no output"):
        compiler.compile(GuidedDecodingParams(grammar="root ::= root root"), "local").result(timeout=GUARD_S)


# ---- cancellation -------------------------------------------------------------------------------


def test_a_compile_nobody_waits_for_is_cancelled_and_its_process_killed(
    make_compiler: Callable[[GrammarBudget], GrammarCompiler],
) -> None:
    compiler = make_compiler(dataclasses.replace(PERMISSIVE, tenant_share=1))
    future = compiler.compile(HUGE, "salt:tenant-1")
    again = compiler.compile(HUGE, "salt:tenant-1")  # a second request of the same tenant waits for it too
    assert again is future
    wait_for(lambda: bool(compiler.pool.running_pids()), "the compile to start")
    [pid] = compiler.pool.running_pids()
    compiler.release(future)
    assert not future.cancelled() and not gone(pid)  # one request still waits
    compiler.release(future)
    assert future.cancelled()
    wait_for(lambda: gone(pid), "the compiling process to be killed")
    assert compiler.cached_keys("salt:tenant-1") == []  # not cached as if it had compiled
    # Its place in the share (1) is back once the killed process's replacement is ready: its next compile runs.
    assert compiler.compile(SMALL, "salt:tenant-1").result(timeout=GUARD_S) is not None


# ---- B's small schema while A's huge one compiles ----------------------------------------------


def test_b_is_not_held_behind_a_in_the_pool(make_compiler: Callable[[GrammarBudget], GrammarCompiler]) -> None:
    compiler = make_compiler(PERMISSIVE)
    a = [compiler.compile(GuidedDecodingParams(json=nested(400 + i)), "salt:tenant-a") for i in range(3)]
    wait_for(lambda: bool(compiler.pool.running_pids()), "A's compiles to start")
    # A has queued three and runs what its share allows; B comes after all of them.
    b = compiler.compile(SMALL, "salt:tenant-b")
    b.result(timeout=GUARD_S)
    assert not any(f.done() for f in a)  # B's compile ended while A's still compile


def test_b_is_served_while_a_compiles_and_a_leaving_kills_its_compile(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu", max_loras=0, max_model_len=256, num_kv_blocks=64, grammar=PERMISSIVE)
    engine = llm.llm_engine
    try:
        prompt = engine.encode("Hello")[1]
        engine.add_request("a", {"prompt_token_ids": prompt, "cache_salt": "tenant-a"},
                           SamplingParams(max_tokens=8, guided_decoding=HUGE))
        engine.add_request("b", {"prompt_token_ids": prompt, "cache_salt": "tenant-b"},
                           SamplingParams(max_tokens=8, temperature=0, guided_decoding=SMALL))
        finished: dict[str, Any] = {}
        deadline = time.monotonic() + GUARD_S
        while "b" not in finished:
            assert time.monotonic() < deadline, "B's request did not finish"
            finished.update({out.request_id: out for out in engine.step() if out.finished})
            time.sleep(0.01)
        assert finished["b"].outputs[0].finish_reason in ("stop", "length")
        assert "a" not in finished
        pids = engine.grammars.pool.running_pids()
        assert len(pids) == 1  # A's compile still runs, B's request is done
        engine.abort_request("a")  # A hangs up: its compile is cancelled
        wait_for(lambda: gone(pids[0]), "A's compiling process to be killed")
        assert engine.grammars.pool.running_pids() == []
    finally:
        engine.shutdown()


def test_a_tools_schema_past_the_budget_is_refused_before_its_conversion() -> None:
    from serving.engine.server.tool_grammar import tool_call_grammar
    from serving.engine.server.tool_parsers import family_for

    family = family_for("hermes", None)
    assert family is not None
    deep = [{"name": "f", "parameters": nested(40)}]  # 81 JSON levels under the call's own 2
    with pytest.raises(GrammarTooComplex, match="the tools' parameters schema nests 83 levels deep") as caught:
        tool_call_grammar(family, deep, parallel=False, budget=GrammarBudget())
    assert caught.value.code == "grammar_too_complex"
    assert tool_call_grammar(family, [{"name": "f", "parameters": nested(3)}], parallel=False, budget=GrammarBudget())


# The engine-core child forked from the zygote (tests/engine/conftest.py), as
# test_process_engine.py starts it: the pool's processes are still the child's own.
@pytest.mark.usefixtures("engine_core_forked")
def test_the_process_engine_compiles_in_its_pool_and_leaves_no_process(tiny_llama_dir: Path) -> None:
    """With the engine core in a child process the pool's processes are the child's; a refusal
    crosses the pipe with its code; the child's shutdown (or death) takes them along."""
    import asyncio

    from serving.engine import EngineConfig
    from serving.engine.process_engine import ProcessEngine

    engine = ProcessEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", max_loras=0, max_model_len=256,
                                        num_kv_blocks=64))
    choice = SamplingParams(max_tokens=8, temperature=0, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))

    async def run() -> tuple[str, BaseException]:
        outputs = [out async for out in engine.generate("Hello", choice, "choice")]
        with pytest.raises(GrammarTooComplex) as caught:
            async for _ in engine.generate("Hello", SamplingParams(max_tokens=8, guided_decoding=HUGE), "huge"):
                pass
        return outputs[-1].outputs[0].text, caught.value

    try:
        text, error = asyncio.run(run())
        assert text in ("yes", "no")
        assert getattr(error, "code", None) == "grammar_too_complex"
        family = psutil.Process(engine.pid).children(recursive=True)
        assert any("serving.engine.grammar_worker" in " ".join(p.cmdline()) for p in family)
    finally:
        engine.shutdown()
    wait_for(lambda: all(gone(p.pid) for p in family), "the pool's processes to end with the engine")


def test_the_worker_flags_reach_the_engines_budget(tiny_llama_dir: Path) -> None:
    from serving.engine.server.cli import parse_args
    from serving.engine.server.worker import engine_config

    default = engine_config(parse_args(["--model", str(tiny_llama_dir)])).grammar
    assert default == GrammarBudget() and (default.timeout, default.workers, default.share) == (5.0, 2, 1)
    budget = engine_config(parse_args([
        "--model", str(tiny_llama_dir), "--grammar-compile-timeout", "2.5", "--grammar-compile-workers", "4",
        "--grammar-tenant-share", "2", "--max-grammar-schema-depth", "16"])).grammar
    assert (budget.timeout, budget.workers, budget.share, budget.max_schema_depth) == (2.5, 4, 2, 16)
    with pytest.raises(ValueError, match="tenant_share must be in 1..workers"):
        engine_config(parse_args(["--model", str(tiny_llama_dir), "--grammar-tenant-share", "3"]))


def test_a_compile_past_its_memory_is_refused(make_compiler: Callable[[GrammarBudget], GrammarCompiler]) -> None:
    """A 44 KB schema of objects nested 4 deep, 6 wide (a 4 MB compiled grammar at the tiny
    vocabulary) with 8 MiB a compile: the library's allocation fails in its process."""
    compiler = make_compiler(GrammarBudget(max_compile_memory_bytes=8 << 20))
    wide: dict[str, Any] = {"type": "string"}
    for _ in range(4):
        wide = {"type": "object", "properties": {f"p{i}": wide for i in range(6)}}
    with pytest.raises(GrammarTooComplex, match="needs more memory than this worker's 8,388,608 bytes"):
        compiler.compile(GuidedDecodingParams(json=wide), "local").result(timeout=GUARD_S)


def test_each_size_bound_refuses_with_grammar_too_complex(make_compiler: Callable[[GrammarBudget], GrammarCompiler]) -> None:
    compiler = make_compiler(GrammarBudget(max_constraint_bytes=4_000, max_grammar_bytes=2_000, max_compiled_bytes=5_000))
    refused = compiler.compile(GuidedDecodingParams(regex="a" * 4_001), "local")
    assert refused.done()  # the text's size: before it is queued
    with pytest.raises(GrammarTooComplex, match="the regex is 4,001 bytes; this worker compiles at most 4,000"):
        refused.result()
    # What a schema becomes, measured in the compiling process.
    with pytest.raises(GrammarTooComplex, match="it becomes a grammar of .* bytes, over this worker's limit of 2,000"):
        compiler.compile(GuidedDecodingParams(json=nested(20)), "local").result(timeout=GUARD_S)
    # The compiled grammar's bytes (xgrammar's memory_size_bytes, which grows with the vocabulary).
    with pytest.raises(GrammarTooComplex, match="its compiled grammar takes .* bytes, over this worker's limit of 5,000"):
        compiler.compile(GuidedDecodingParams(json=nested(2)), "local").result(timeout=GUARD_S)


# ---- a killed process's replacement (the pool with a stub process) ----------------------------

STUB = Path(__file__).with_name("grammar_worker_stub.py")


class _StubTable:
    """The tokenizer table the pool writes for its processes; the stub never reads it."""

    def serialize_json(self) -> str:
        return "{}"


def _stub_pool(gate: Path, budget: GrammarBudget) -> GrammarPool:
    return GrammarPool(lambda: _StubTable(), budget, command=(sys.executable, str(STUB), str(gate)))  # type: ignore[arg-type, return-value]


def _ready(gate: Path) -> int:
    return len(list(gate.glob("ready-*")))


def _forkers(gate: Path) -> list[psutil.Process]:
    """The stub forkers of the pool whose gate is ``gate`` (this test process has other children: an
    xdist worker's zygote, an earlier test's forker still ending, ones not reaped yet, whose command
    line cannot be read)."""
    found = []
    for child in psutil.Process().children():
        try:
            if child.cmdline()[1:3] == [str(STUB), str(gate)]:
                found.append(child)
        except psutil.Error:  # a zombie, or gone meanwhile: not a live forker
            continue
    return found


def test_a_killed_compiles_replacement_is_its_own_tenants_wait(tmp_path: Path) -> None:
    """A's compile runs past its time and is killed; while its replacement starts, A's next compile
    waits for it, and B's takes the one ready process (were A's share freed at the kill, A's next
    would take it and B's would wait for the start)."""
    pool = _stub_pool(tmp_path, GrammarBudget(timeout=0.3, workers=2))  # a tenant's share: 1
    try:
        assert "stub compiled warm" in str(pool.submit("B", "json", "warm", "JSON schema").exception(timeout=GUARD_S))
        wait_for(lambda: _ready(tmp_path) == 2, "both processes to be ready")
        (tmp_path / "hold").touch()  # from now on a process's start lasts until the test ends it
        first = pool.submit("A", "json", "hang", "JSON schema")
        second = pool.submit("A", "json", "hang", "JSON schema")
        assert isinstance(first.exception(timeout=GUARD_S), GrammarTooComplex)  # killed past 0.3 s
        b = pool.submit("B", "json", "small", "JSON schema")
        assert "stub compiled small" in str(b.exception(timeout=GUARD_S))
        assert not second.done() and pool.running_pids() == [], "A's next waits for its replacement"
        (tmp_path / "hold").unlink()
        assert isinstance(second.exception(timeout=GUARD_S), GrammarTooComplex)  # then it runs (and is killed)
    finally:
        pool.close()


def test_a_tenant_whose_compile_crashed_its_process_compiles_again(tmp_path: Path) -> None:
    pool = _stub_pool(tmp_path, GrammarBudget(timeout=60.0, workers=2))
    try:
        crashed = pool.submit("A", "json", "crash", "JSON schema").exception(timeout=GUARD_S)
        assert isinstance(crashed, GrammarTooComplex) and "ran out of resources" in str(crashed)
        # The crash gave A's place in its share to the replacement, which gives it back once ready.
        after = pool.submit("A", "json", "small", "JSON schema").exception(timeout=GUARD_S)
        assert type(after) is GrammarError and "stub compiled small" in str(after)
    finally:
        pool.close()


def test_compiling_processes_are_forked_from_one_process_that_kills_only_its_own(tmp_path: Path) -> None:
    """Every compiling process is a child of the pool's one forker (its table and library loaded
    once), and a kill the forker is asked for reaches only a process it forked."""
    pool = _stub_pool(tmp_path, GrammarBudget(timeout=60.0, workers=2))
    try:
        pool.submit("A", "json", "warm", "JSON schema").exception(timeout=GUARD_S)
        wait_for(lambda: _ready(tmp_path) == 2, "both processes to be ready")
        [forker] = _forkers(tmp_path)
        compiling = {int(path.name.removeprefix("ready-")) for path in tmp_path.glob("ready-*")}
        assert {child.pid for child in forker.children()} == compiling
        assert pool._control is not None  # noqa: SLF001  # the forker's own socket: asked directly
        pool._control.send(("kill", forker.pid))  # noqa: SLF001  # not its child: ignored
        pool._control.send(("kill", psutil.Process().pid))  # noqa: SLF001  # nor is this test's process
        answer = pool.submit("B", "json", "after", "JSON schema").exception(timeout=GUARD_S)
        assert "stub compiled after" in str(answer) and forker.is_running()
        assert {child.pid for child in forker.children()} == compiling
    finally:
        pool.close()
    wait_for(lambda: all(gone(pid) for pid in [forker.pid, *compiling]), "the forker and its processes to end")


def test_a_compile_whose_process_dies_with_its_forker_runs_again_on_the_next(tmp_path: Path) -> None:
    # The task did not kill its process, its forker's death did: it is not "too complex".
    pool = _stub_pool(tmp_path, GrammarBudget(timeout=60.0, workers=2))
    try:
        pool.submit("A", "json", "warm", "JSON schema").exception(timeout=GUARD_S)
        (tmp_path / "stall").touch()
        stalled = pool.submit("A", "json", "stall", "JSON schema")
        wait_for(lambda: len(pool.running_pids()) == 1, "the stalled compile to be under way")
        [forker] = _forkers(tmp_path)
        before = {child.pid for child in forker.children()}
        forker.kill()
        wait_for(lambda: all(gone(pid) for pid in before), "the forker's processes to die with it")
        (tmp_path / "stall").unlink()
        answer = stalled.exception(timeout=GUARD_S)
        assert type(answer) is GrammarError and "stub compiled stall" in str(answer)
    finally:
        pool.close()


def test_a_queue_takes_an_item_back_ahead_of_its_tenants_others() -> None:
    queue: FairQueue[str] = FairQueue(share=1)
    queue.push("A", "a0")
    queue.push("A", "a1")
    queue.push("B", "b0")
    assert queue.pop() == ("A", "a0")
    queue.finished("A")
    queue.push_front("A", "a0")
    assert [queue.pop(), queue.pop()] == [("B", "b0"), ("A", "a0")]
    queue.finished("A")
    assert queue.pop() == ("A", "a1")


def test_a_dead_forker_takes_its_processes_with_it_and_the_pool_starts_another(tmp_path: Path) -> None:
    pool = _stub_pool(tmp_path, GrammarBudget(timeout=60.0, workers=2))
    try:
        pool.submit("A", "json", "warm", "JSON schema").exception(timeout=GUARD_S)
        wait_for(lambda: _ready(tmp_path) == 2, "both processes to be ready")
        [forker] = _forkers(tmp_path)
        before = {child.pid for child in forker.children()}
        forker.kill()
        wait_for(lambda: all(gone(pid) for pid in before), "the forker's processes to die with it")
        answer = pool.submit("A", "json", "again", "JSON schema").exception(timeout=GUARD_S)
        assert type(answer) is GrammarError and "stub compiled again" in str(answer)
        [second] = _forkers(tmp_path)
        assert second.pid != forker.pid and not before & {child.pid for child in second.children()}
    finally:
        pool.close()


def _serve_on_a_closed_socket(info_json: str) -> None:
    """A compiling process whose pool closed its end before the process said it was ready."""
    import multiprocessing.connection as mpc
    import socket

    import xgrammar as xgr

    from serving.engine.grammar_worker import CompileLimits, serve

    mine, pools = socket.socketpair()
    pools.close()
    serve(mpc.Connection(mine.detach()), xgr.TokenizerInfo.deserialize_json(info_json),
          CompileLimits(max_grammar_bytes=1 << 20, max_compiled_bytes=1 << 24, max_compile_memory_bytes=1 << 30))


def test_a_compiling_process_whose_pool_closed_first_ends_quietly(tokenizer: PreTrainedTokenizerBase) -> None:
    """A pool shut down while one of its processes starts: the process ends with status 0 and no
    traceback (a BrokenPipeError on its "ready" used to be printed on the engine's stderr)."""
    import multiprocessing

    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    # Forked: the limit on its data segment that serve sets must not land on the test's own process.
    process = multiprocessing.get_context("fork").Process(target=_serve_on_a_closed_socket,
                                                          args=(info.serialize_json(),))
    process.start()
    process.join(60)
    assert process.exitcode == 0
