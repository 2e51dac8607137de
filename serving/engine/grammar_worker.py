"""A grammar-compiling process of the engine's pool (serving.engine.grammar_pool): it turns one
constraint at a time into xgrammar's compiled grammar and sends it back serialized.

Compiling runs in a process, not on a thread, because xgrammar's compile is C++ that cannot be
interrupted: a constraint past its time budget is stopped by killing its process (the pool starts
another). The grammar's size is bounded here too, where the library exposes it: the EBNF a JSON
schema becomes (its conversion is superlinear in the schema's nesting) and the compiled grammar's
bytes; and the memory a compile may take, by the process's data limit (RLIMIT_DATA, set once the
library and the tokenizer's table are in: a compile past it fails with the library's bad_alloc). A grammar whose language is empty (``root ::= root root``) is refused as well: its first
token mask allows nothing, and a row of -inf logits cannot be sampled.

Started by the pool as ``python -m serving.engine.grammar_worker FD``, ``FD`` its end of a socket
pair, this process imports the library, reads the tokenizer's table once, then forks a compiling
process per request (serving.engine.forker): each is ready in milliseconds, where a cold start
took seconds (the library's import, then the table). Messages (pickled, multiprocessing.connection's
framing):

    pool -> this process: ("init", tokenizer_info_path, limits) once, then the forker's requests
    pool -> a compiling process: ("compile", task_id, kind, text)
    a compiling process -> pool: ("ready", pid) once, then per task ("ok", task_id, compiled_json,
                                 memory_bytes) or ("error", task_id, too_complex, message)

It imports xgrammar only (not the engine), so it starts in the library's own import time.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import sys
from pathlib import Path
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

# A JSON schema's grammar, bounded (issue 39, item 4); it imports only the grammar library.
from serving.engine.forker import die_with_parent, serve_forks
from serving.engine.json_grammar import json_schema_grammar

if TYPE_CHECKING:
    import xgrammar

# xgrammar's messages start with "[hh:mm:ss] /project/cpp/file.cc:123: "; the caller needs the rest.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


@dataclass(frozen=True)
class CompileLimits:
    """What one compiled constraint may cost besides its time: the EBNF text a constraint becomes
    (a schema's conversion), and the compiled grammar's bytes (memory_size_bytes: its token-mask
    cache, which grows with the vocabulary)."""

    max_grammar_bytes: int
    max_compiled_bytes: int
    max_compile_memory_bytes: int


def library_detail(exc: Exception) -> str:
    """The grammar library's message for the caller (without its log line's prefix)."""
    return _LOG_PREFIX.sub("", str(exc).strip())


class TooComplex(Exception):
    """The constraint is past a size limit (CompileLimits)."""


def compile_constraint(compiler: xgrammar.GrammarCompiler, kind: str, text: str,
                       limits: CompileLimits) -> xgrammar.CompiledGrammar:
    """Compile one constraint (GuidedDecodingParams.key's kind and text). RuntimeError: the library
    refuses it; TooComplex: past `limits`; ValueError: its language is empty."""
    import xgrammar as xgr

    if kind == "regex":
        compiled = compiler.compile_regex(text)
    else:
        if kind == "json":
            ebnf = json_schema_grammar(text)
        elif kind == "json_object":
            ebnf = json_schema_grammar('{"type": "object"}')
        else:  # "grammar" (a choice comes as its EBNF: serving.engine.guided)
            ebnf = text
        if len(ebnf) > limits.max_grammar_bytes:
            raise TooComplex(f"it becomes a grammar of {len(ebnf):,} bytes, over this worker's limit of "
                             f"{limits.max_grammar_bytes:,}")
        compiled = compiler.compile_grammar(ebnf)
    if compiled.memory_size_bytes > limits.max_compiled_bytes:
        raise TooComplex(f"its compiled grammar takes {compiled.memory_size_bytes:,} bytes, over this worker's "
                         f"limit of {limits.max_compiled_bytes:,}")
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    if not bool(mask.any()):
        raise ValueError("it matches no output at all (every rule needs itself before any text)")
    return compiled


def _limit_memory(extra: int) -> None:
    """Let this process's heap grow by at most `extra` bytes from here (Linux: RLIMIT_DATA counts
    its private writable memory, which the library's imports have already taken their share of)."""
    status = Path("/proc/self/status")
    if not status.exists():
        return
    found = re.search(r"^VmData:\s+(\d+) kB", status.read_text(), re.MULTILINE)
    if found is not None:
        limit = int(found.group(1)) * 1024 + extra
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def serve(conn: Connection, info: xgrammar.TokenizerInfo, limits: CompileLimits) -> None:
    """A compiling process's life (forked): its compiler, its memory limit, then compiles until the
    pool closes its socket. A pool that closed it first (it was shut down while this process
    started, or left mid-compile) ends the process quietly: nobody is left to answer."""
    try:
        _compile_until_closed(conn, info, limits)
    except (BrokenPipeError, ConnectionResetError):
        return


def _compile_until_closed(conn: Connection, info: xgrammar.TokenizerInfo, limits: CompileLimits) -> None:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _limit_memory(limits.max_compile_memory_bytes)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            _, task_id, kind, text = conn.recv()
        except EOFError:
            return
        try:
            compiled = compile_constraint(compiler, kind, text, limits)
        except TooComplex as exc:
            conn.send(("error", task_id, True, str(exc)))
        except (MemoryError, RuntimeError, ValueError) as exc:
            if isinstance(exc, MemoryError) or "bad_alloc" in str(exc):  # past the data limit
                conn.send(("error", task_id, True, f"compiling it needs more memory than this worker's "
                                                   f"{limits.max_compile_memory_bytes:,} bytes"))
            else:
                conn.send(("error", task_id, False, library_detail(exc)))
        else:
            conn.send(("ok", task_id, compiled.serialize_json(), compiled.memory_size_bytes))


def main() -> None:
    die_with_parent()
    # SIGINT goes to the whole foreground group on Ctrl-C; the engine stops its pool itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control = Connection(int(sys.argv[1]))
    message: Any = control.recv()
    _, tokenizer_info_path, limits = message
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(Path(tokenizer_info_path).read_text())
    serve_forks(control, lambda conn: serve(conn, info, limits))


if __name__ == "__main__":
    main()
