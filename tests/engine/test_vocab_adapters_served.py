"""Adapters on the vocabulary modules, served beside plain LoRA adapters and the base in one batch,
generate what PEFT generates (issue 41, item 4; docs/adapter-kinds.md, "Vocabulary modules").

For three families (Llama, Qwen2, Mistral) one batch mixes: an adapter with LoRA on
``embed_tokens`` and ``lm_head`` (and ``q_proj``); an adapter whose ``modules_to_save`` copies of
both matrices differ from the base's in a few rows (and LoRA on ``v_proj``); an adapter with PEFT's
trainable tokens on both (``trainable_token_indices``, and LoRA on ``k_proj``); a plain LoRA
adapter; and the base. Two GPU slots for four adapters, so they take turns in the slots and a slot's
vocabulary part left from the adapter before would show. Each prompt's greedy tokens and their
log-probabilities equal PEFT's for that prompt alone with its adapter (one PEFT model per adapter:
PEFT cannot hold LoRA on an embedding and a modules_to_save copy of it in one model). What is not
served is refused naming it; the bytes an adapter's vocabulary part takes are counted where the
adapter's bytes are.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from peft_reference import PeftReference, assert_greedy_match
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer
from vocab_adapters import save_vocab_adapter

from serving.engine import LLM, LoRARequest, SamplingParams
from serving.engine.layers.vocab_lora import VocabAdapters
from serving.engine.lora.cache import max_vocab_bytes
from serving.engine.lora.reader import MAX_CHANGED_ROWS_DIVISOR, AdapterError, BaseShapes, VocabDelta, load_adapter
from serving.engine.lora.records import CachedAdapter

PROMPTS = ["Once upon a time there was a little house at the edge of the forest", "Hello!", "The sky is"]
MAX_TOKENS = 8
LOGPROB_TOLERANCE = 1e-4
# lm_head rows the modules_to_save adapter changes (and the trainable tokens one): its changed logits
# make these tokens come up.
HEAD_ROWS = tuple(range(100, 106))
TOKEN_HEAD_ROWS = [113, 110, 111]  # in no order: PEFT keeps the config's
ENGINE = dict(max_lora_rank=8, dtype="float32", max_model_len=128, block_size=4, num_kv_blocks=96)
# On CUDA (gpu mark) the same runs in fp32 against PEFT on the CPU, with the decode graphs captured.
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vocab_adapter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Path]]:
    """``vocab_adapter(base_dir, **save_vocab_adapter's options)`` → a new adapter directory."""
    root = tmp_path_factory.mktemp("vocab-adapters")
    count = iter(range(1_000))
    yield lambda base_dir, **options: save_vocab_adapter(base_dir, root / f"adapter-{next(count)}", **options)


def _prompt_tokens(base_dir: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    return sorted({t for prompt in PROMPTS for t in tokenizer(prompt).input_ids})


def _embed_rows(base_dir: Path) -> list[int]:
    """Embedding rows the modules_to_save adapter changes: tokens of the prompts (so that they matter)."""
    return _prompt_tokens(base_dir)[:6]


def _adapters(base: Path, vocab_adapter: Callable[..., Path], make_adapter: Callable[..., Path]) -> dict[str, Path]:
    return {
        "vocab-lora": vocab_adapter(base, r=4, lora_alpha=8, target_modules=("q_proj", "embed_tokens", "lm_head"),
                                    seed=1),
        "saved-rows": vocab_adapter(base, r=4, lora_alpha=8, target_modules=("v_proj",),
                                    modules_to_save=("embed_tokens", "lm_head"),
                                    changed={"embed_tokens": _embed_rows(base), "lm_head": HEAD_ROWS}, seed=2),
        "token-rows": vocab_adapter(base, r=4, lora_alpha=8, target_modules=("k_proj",), seed=11,
                                    trainable_tokens={"embed_tokens": _prompt_tokens(base)[:-7:-1],
                                                      "lm_head": TOKEN_HEAD_ROWS}),
        "plain": make_adapter(base, r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), seed=3, init_scale=0.5),
    }


@pytest.mark.parametrize(("arch", "async_scheduling", "device"), [
    pytest.param("llama", False, "cpu", id="llama"),
    pytest.param("qwen2", False, "cpu", id="qwen2"),
    pytest.param("mistral", False, "cpu", id="mistral"),
    pytest.param("llama", True, "cpu", id="llama-async"),
    pytest.param("llama", False, "cuda", marks=_CUDA, id="llama-cuda-graphs"),
])
def test_vocabulary_adapters_plain_lora_and_the_base_in_one_batch_match_peft(
        arch: str, async_scheduling: bool, device: str, tiny_model_factory: Callable[..., Path],
        make_adapter: Callable[..., Path], vocab_adapter: Callable[..., Path]) -> None:
    """("-async": each step is queued while the one before is in flight, its decode rows' token ids
    taken on the device from that step's samples, which the embedding part then reads.)"""
    base = tiny_model_factory(arch)
    adapters = _adapters(base, vocab_adapter, make_adapter)
    llm = LLM(str(base), max_loras=2, async_scheduling=async_scheduling, device=device, **ENGINE)
    tokenizer = llm.get_tokenizer()
    names: list[str | None] = ["vocab-lora", "saved-rows", "token-rows", "plain", None]
    inputs = [{"prompt_token_ids": tokenizer(p).input_ids} for p in PROMPTS for _ in names]
    loras = [LoRARequest(n, str(adapters[n])) if n else None for _ in PROMPTS for n in names]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(inputs, greedy, lora_request=loras)
    assert llm.llm_engine.stats().slot_evictions > 0, "four adapters over two slots must take turns"

    references = {name: PeftReference(base, {name: adapters[name]} if name else {}) for name in names}
    tokens: dict[str | None, list[list[int]]] = {}
    for prompt, lora, output in zip(inputs, loras, outputs):
        name = lora.lora_name if lora else None
        ours = output.outputs[0]
        ref = references[name].generate(prompt["prompt_token_ids"], name, MAX_TOKENS)
        label = f"{arch} {name or 'base'} ({len(prompt['prompt_token_ids'])} prompt tokens)"
        assert_greedy_match(ours.token_ids, ref, label)
        assert ours.logprobs is not None
        for step, (token, theirs) in enumerate(zip(ours.token_ids, ref.token_ids)):
            if token != theirs:
                break
            expected = float(ref.logits[step].log_softmax(-1)[token])
            ours_lp = ours.logprobs[step][token].logprob
            assert math.isclose(ours_lp, expected, abs_tol=LOGPROB_TOLERANCE), (
                f"{label}: token {step}'s log-probability {ours_lp} is not PEFT's {expected}")
        tokens.setdefault(name, []).append(list(ours.token_ids))
    # The vocabulary parts matter: without them these adapters would be LoRA on one projection.
    for name in ("vocab-lora", "saved-rows", "token-rows"):
        assert tokens[name] != tokens[None] and tokens[name] != tokens["plain"], f"{name} seems not applied"
    assert any(t in HEAD_ROWS for row in tokens["saved-rows"] for t in row), "the changed lm_head rows never counted"
    assert any(t in TOKEN_HEAD_ROWS for row in tokens["token-rows"] for t in row), "the trained lm_head rows never came"
    graphs = llm.llm_engine.runner.graphs
    if graphs is not None:
        # The graphs hold no vocabulary step: a batch of a vocabulary adapter alone never replays one, a
        # batch of the plain adapter and the base still does (the vocabulary adapters resident meanwhile).
        before = graphs.replays
        again = llm.generate(inputs[:1], greedy, lora_request=loras[:1])[0]
        assert graphs.replays == before and list(again.outputs[0].token_ids) == tokens["vocab-lora"][0]
        llm.generate(inputs[3:5], greedy, lora_request=loras[3:5])
        assert graphs.replays > before


def test_peft_s_default_save_of_lora_on_the_vocabulary_keeps_no_rows(tiny_llama_dir: Path,
                                                                     vocab_adapter: Callable[..., Path]) -> None:
    """PEFT saves the base's two matrices whole beside LoRA on them (``save_embedding_layers``, its
    default then): equal to the base, they cost no rows, and the adapter serves as PEFT does."""
    adapter = vocab_adapter(tiny_llama_dir, target_modules=("embed_tokens", "lm_head"), seed=10,
                            save_embedding_layers=True)
    copies = {"base_model.model.model.embed_tokens.base_layer.weight", "base_model.model.lm_head.base_layer.weight"}
    assert copies <= set(load_file(adapter / "adapter_model.safetensors"))
    llm = LLM(str(tiny_llama_dir), max_loras=1, device="cpu", **ENGINE)
    ids = llm.get_tokenizer()(PROMPTS[2]).input_ids
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": ids}], greedy, lora_request=LoRARequest("v", str(adapter)))[0]
    assert llm.llm_engine.lora_cache is not None
    loaded = llm.llm_engine.lora_cache.named()["v"]
    assert loaded.vocab is not None and loaded.vocab.embed_rows is None and loaded.vocab.head_rows is None
    reference = PeftReference(tiny_llama_dir, {"v": adapter}).generate(ids, "v", MAX_TOKENS)
    assert_greedy_match(list(output.outputs[0].token_ids), reference, "llama, base_layer copies")


def test_prompt_logprobs_of_a_vocabulary_adapter_are_peft_s(tiny_llama_dir: Path, make_adapter: Callable[..., Path],
                                                             vocab_adapter: Callable[..., Path]) -> None:
    """A prompt's own logprobs (computed by the eager path's own call of the head) carry the
    adapter's head part too."""
    adapter = _adapters(tiny_llama_dir, vocab_adapter, make_adapter)["saved-rows"]
    llm = LLM(str(tiny_llama_dir), max_loras=1, device="cpu", **ENGINE)
    ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    output = llm.generate([{"prompt_token_ids": ids}], params, lora_request=LoRARequest("s", str(adapter)))[0]
    reference = PeftReference(tiny_llama_dir, {"s": adapter}).model
    with torch.no_grad():
        logp = reference(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert output.prompt_logprobs is not None
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        token = ids[position]
        assert entry is not None
        assert math.isclose(entry[token].logprob, float(logp[position - 1, token]), abs_tol=LOGPROB_TOLERANCE)


def test_a_copy_keeps_only_its_changed_rows_and_every_byte_is_counted(
        tiny_llama_dir: Path, make_adapter: Callable[..., Path], vocab_adapter: Callable[..., Path]) -> None:
    adapters = _adapters(tiny_llama_dir, vocab_adapter, make_adapter)
    llm = LLM(str(tiny_llama_dir), max_loras=2, device="cpu", **ENGINE)
    engine = llm.llm_engine
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    vocab, hidden, layers = config.vocab_size, config.hidden_size, config.num_hidden_layers
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(["Hello!", "Hello!"], greedy,
                 lora_request=[LoRARequest(n, str(adapters[n])) for n in ("vocab-lora", "saved-rows")])
    assert engine.lora_cache is not None
    named = engine.lora_cache.named()
    saved = named["saved-rows"]
    assert saved.vocab is not None and saved.vocab.embed_rows is not None and saved.vocab.head_rows is not None
    assert saved.vocab.embed_rows[0].tolist() == _embed_rows(tiny_llama_dir)
    assert saved.vocab.head_rows[0].tolist() == list(HEAD_ROWS)
    assert saved.vocab.embed_lora is None and saved.vocab.head_lora is None
    # fp32 throughout: the projections' rows (A [r, hidden], B^T [r, out] per layer) and the vocabulary parts.
    kv = config.num_key_value_heads * hidden // config.num_attention_heads
    rows = 4 * 4 * layers * (2 * hidden + hidden + kv)  # r=4: q_proj (64 -> 64) or v_proj (64 -> kv)
    q_rows = 4 * 4 * layers * 2 * hidden
    v_rows = rows - q_rows
    changed = len(_embed_rows(tiny_llama_dir)) + len(HEAD_ROWS)
    assert saved.nbytes == v_rows + changed * (4 * hidden + 8)
    lora = named["vocab-lora"]
    assert lora.nbytes == q_rows + 2 * 4 * 4 * (vocab + hidden)
    # The CPU cache's bytes and those copied into the slots (each adapter placed once) count the parts.
    stats = engine.lora_cache.stats
    assert stats.cpu_bytes == stats.bytes_loaded == saved.nbytes + lora.nbytes
    # On the device each slot holds its own vocabulary part, never a base matrix.
    vocab_parts = engine.runner.model.vocab_adapters
    assert vocab_parts is not None
    assert vocab_parts.nbytes == saved.nbytes - v_rows + lora.nbytes - q_rows
    assert vocab_parts.nbytes < vocab * hidden * 4
    # The CPU cache reserves for a read in flight what the largest adapter can take, its vocabulary part included.
    shapes = BaseShapes.from_config(config)
    assert engine.lora_cache._cpu.entry_bytes == 8 * engine.runner.lora_row_bytes + max_vocab_bytes(
        shapes, 8, torch.float32) + 4 * layers * sum(out for _, out in shapes.modules.values())


def test_the_reserved_bytes_are_those_of_the_largest_vocabulary_part(
        tiny_llama_dir: Path, vocab_adapter: Callable[..., Path]) -> None:
    """LoRA of the largest rank on both modules and copies changed in as many rows as are let
    through take exactly ``max_vocab_bytes``."""
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    limit = config.vocab_size // MAX_CHANGED_ROWS_DIVISOR
    changed = {module: range(limit) for module in ("embed_tokens", "lm_head")}
    both = vocab_adapter(tiny_llama_dir, r=8, target_modules=("embed_tokens", "lm_head"), seed=4)
    saved = vocab_adapter(tiny_llama_dir, r=8, target_modules=("q_proj",), modules_to_save=("embed_tokens", "lm_head"),
                          changed=changed, seed=5)
    base = load_file(tiny_llama_dir / "model.safetensors")
    matrices = {"embed_tokens": base["model.embed_tokens.weight"], "lm_head": base["lm_head.weight"]}
    parts = [load_adapter(path, base_config=config, max_lora_rank=8, base_vocab=matrices.__getitem__).vocab
             for path in (both, saved)]
    assert all(part is not None for part in parts)
    largest = sum(part.converted(torch.bfloat16, pin_memory=False).nbytes for part in parts if part is not None)
    assert largest == max_vocab_bytes(BaseShapes.from_config(config), 8, torch.bfloat16)


# ---- refusals -------------------------------------------------------------------------------------


def _load(path: Path, config: object, **options: object) -> object:
    base = load_file(Path(config.name_or_path) / "model.safetensors")  # type: ignore[attr-defined]
    matrices = {"embed_tokens": base["model.embed_tokens.weight"], "lm_head": base["lm_head.weight"]}
    return load_adapter(path, base_config=config, max_lora_rank=8, base_vocab=matrices.__getitem__, **options)


def test_a_copy_changed_in_too_many_rows_is_refused_at_load_naming_the_module(
        tiny_llama_dir: Path, vocab_adapter: Callable[..., Path]) -> None:
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    limit = config.vocab_size // MAX_CHANGED_ROWS_DIVISOR
    adapter = vocab_adapter(tiny_llama_dir, target_modules=("q_proj",), modules_to_save=("lm_head",),
                            changed={"lm_head": range(limit + 1)}, seed=6)
    message = (rf"lm_head\.weight: {limit + 1} of lm_head's {config.vocab_size} rows differ from the base model's, "
               rf"more than 1/8 of the vocabulary \({limit} rows\): that is a full copy of the matrix")
    with pytest.raises(AdapterError, match=message):
        _load(adapter, config)
    # Through the engine: the request fails with the same reason.
    llm = LLM(str(tiny_llama_dir), max_loras=1, device="cpu", **ENGINE)
    with pytest.raises(AdapterError, match=message):
        llm.generate(["Hello"], SamplingParams(max_tokens=2), lora_request=LoRARequest("copy", str(adapter)))


def test_other_modules_to_save_are_refused_naming_them(tiny_llama_dir: Path,
                                                        vocab_adapter: Callable[..., Path]) -> None:
    adapter = vocab_adapter(tiny_llama_dir, target_modules=("q_proj",), modules_to_save=("lm_head", "norm"), seed=7)
    with pytest.raises(AdapterError, match=r"modules_to_save \(norm\) is not supported: .*whole copies"):
        _load(adapter, AutoConfig.from_pretrained(tiny_llama_dir))


def test_a_resized_vocabulary_is_refused_saying_so(tiny_llama_dir: Path, vocab_adapter: Callable[..., Path]) -> None:
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    adapter = vocab_adapter(tiny_llama_dir, target_modules=("q_proj",), modules_to_save=("embed_tokens",), seed=8)
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = "base_model.model.model.embed_tokens.weight"
    tensors[name] = torch.cat([tensors[name], torch.zeros(3, config.hidden_size)])  # three new tokens
    save_file(tensors, weights)
    with pytest.raises(AdapterError, match=rf"embed_tokens\.weight has a vocabulary of {config.vocab_size + 3} tokens, "
                                           rf"but the base model's embed_tokens has {config.vocab_size}: adapters that "
                                           r"resize the vocabulary \(new tokens\) are not served"):
        _load(adapter, config)


def test_vocabulary_adapters_are_refused_on_tied_bases_with_dora_and_where_the_engine_says(
        tiny_llama_dir: Path, vocab_adapter: Callable[..., Path]) -> None:
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    adapter = vocab_adapter(tiny_llama_dir, target_modules=("embed_tokens", "lm_head"), seed=9)
    tied = copy.deepcopy(config)
    tied.tie_word_embeddings = True
    with pytest.raises(AdapterError, match=r"adapts embed_tokens, lm_head, but the base model ties lm_head to "
                                           r"embed_tokens"):
        _load(adapter, tied)
    with pytest.raises(AdapterError, match=r"vocabulary modules \(embed_tokens, lm_head\) are not served here: not "
                                           r"under tensor parallelism"):
        _load(adapter, config, vocab_refusal="not under tensor parallelism")
    adapter_config = adapter / "adapter_config.json"
    adapter_config.write_text(json.dumps({**json.loads(adapter_config.read_text()), "use_dora": True}))
    with pytest.raises(AdapterError, match=r"DoRA on embed_tokens, lm_head is not served"):
        _load(adapter, config)


def test_a_slot_taken_by_an_adapter_without_a_vocabulary_part_or_freed_drops_the_one_before() -> None:
    vocab_parts = VocabAdapters(torch.device("cpu"))
    rows = (torch.tensor([3, 7]), torch.ones(2, 4))
    with_rows = CachedAdapter(digest="a", path="a", rank=1, lora_alpha=1, scaling=1.0, target_modules=(), weights={},
                              load_seconds=0.0)  # fmt: skip
    with_rows.vocab = VocabDelta(embed_rows=rows)
    with_rows.slot = 0  # as the slot table places it before the write
    plain = CachedAdapter(digest="b", path="b", rank=1, lora_alpha=1, scaling=1.0, target_modules=(), weights={},
                          load_seconds=0.0)  # fmt: skip
    vocab_parts.write(0, with_rows)
    assert vocab_parts.serves([-1, 0]) and not vocab_parts.serves([-1, 1])
    assert vocab_parts.nbytes == 2 * 8 + 2 * 4 * 4
    hidden = torch.zeros(3, 4)
    assert vocab_parts.begin_step([0, -1, 0])
    vocab_parts.embed(hidden, torch.tensor([7, 7, 5]))
    assert hidden.tolist() == [[1.0] * 4, [0.0] * 4, [0.0] * 4], "token 7 of slot 0 takes its row; 5 has none"
    vocab_parts.write(0, plain)
    assert not vocab_parts.serves([0]) and vocab_parts.nbytes == 0
    assert not vocab_parts.begin_step([0, -1])
    # An adapter freed from its slot (nothing placed there since) leaves the device at the next step.
    vocab_parts.write(1, with_rows)
    with_rows.slot = None
    assert vocab_parts.nbytes > 0 and not vocab_parts.begin_step([-1]) and vocab_parts.nbytes == 0


@pytest.mark.parametrize(("indices", "message"), [
    ({"embed_tokens": [1, 2, "V"]}, r"has token id V, outside the base model's vocabulary of V: adapters that add "
                                    r"tokens to the vocabulary are not served"),
    ({"embed_tokens": [1, 2, 2]}, r"trainable_token_indices for embed_tokens names a token twice"),
    ({"embed_tokens": [1, 2, 3], "norm": [1]}, r"trainable_token_indices on norm is not supported"),
    ({"embed_tokens": [1, 2]}, r"trainable_tokens_delta has 3 rows, but trainable_token_indices names 2 tokens"),
], ids=["new-token", "twice", "other-module", "rows"])
def test_trainable_tokens_beyond_the_vocabulary_or_not_matching_their_rows_are_refused(
        tiny_llama_dir: Path, vocab_adapter: Callable[..., Path], indices: dict[str, list[object]],
        message: str) -> None:
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    adapter = vocab_adapter(tiny_llama_dir, target_modules=("q_proj",), trainable_tokens={"embed_tokens": [1, 2, 3]},
                            seed=12)
    vocab = config.vocab_size
    adapter_config = adapter / "adapter_config.json"
    edited = {module: [vocab if t == "V" else t for t in ids] for module, ids in indices.items()}
    adapter_config.write_text(json.dumps({**json.loads(adapter_config.read_text()), "trainable_token_indices": edited}))
    with pytest.raises(AdapterError, match=message.replace("V", str(vocab))):
        _load(adapter, config)


def test_too_many_trainable_tokens_are_refused(tiny_llama_dir: Path, vocab_adapter: Callable[..., Path]) -> None:
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    limit = config.vocab_size // MAX_CHANGED_ROWS_DIVISOR
    adapter = vocab_adapter(tiny_llama_dir, target_modules=("q_proj",),
                            trainable_tokens={"lm_head": list(range(limit + 1))}, seed=13)
    with pytest.raises(AdapterError, match=rf"trainable_token_indices for lm_head names {limit + 1} tokens, more than "
                                           rf"1/8 of the vocabulary \({limit}\)"):
        _load(adapter, config)
