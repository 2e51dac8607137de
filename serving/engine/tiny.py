"""Tiny Hugging Face causal-LM directories with random weights, built in code in seconds.

Tests, demos, CI and `make up` need a real base model (config + safetensors + tokenizer) of the
Llama, Qwen2, Qwen3 and Mistral families (and Llama 3.x, Phi-3, Gemma 2, Gemma 3) without
downloading anything. `build_tiny_model` writes one:
random weights drawn from a seeded generator (same seed, same files, byte for byte) and a byte-level
BPE tokenizer trained on the English text below, with a ChatML chat template.

`save_random_peft_adapter` writes a PEFT LoRA adapter for such a model whose B matrices are
non-zero (PEFT initialises B to zero, which would make every adapter a no-op in tests).

    python -m serving.engine.tiny OUT [--arch llama|qwen2|qwen3|mistral|llama3|phi3|gemma2|gemma3_text]
                                     [--size tiny|small] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

# The Llama family, which every per-architecture engine suite runs (tests/engine/conftest.py); the
# other architectures differ in module names or layer structure, and tests/engine/test_architectures.py
# runs them. Every name in ALL_ARCHS can be built.
ARCHS = ("llama", "qwen2", "qwen3", "mistral")
OTHER_ARCHS = ("llama3", "phi3", "gemma2", "gemma3_text")
ALL_ARCHS = ARCHS + OTHER_ARCHS

# Layer sizes. `tiny` keeps tests fast; `small` is big enough for CPU benchmarks to mean something.
# Both use grouped-query attention (fewer KV heads than heads), as the real models do.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 2048,
    },
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1408,
        "max_position_embeddings": 2048,
    },
}

VOCAB_SIZE = 512

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|begin_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Unused by the template, but transformers' Qwen2Tokenizer defaults its unk token to it and would
# append it past the model's vocabulary if the vocabulary lacked it.
END_OF_TEXT = "<|endoftext|>"
# The chat turn terminator is the EOS token (as in Qwen2-Instruct), so a chat reply ends on EOS.
EOS_TOKEN = IM_END
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, IM_START, IM_END, END_OF_TEXT)

# ChatML, with tools as Qwen2.5 writes them (Hermes' format): the functions' signatures in a system
# turn, each call as `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>` in the assistant's
# turn, a tool's result as a user turn in <tool_response> tags. Without tools it renders as plain
# ChatML. Assistant content and calls sit in a {% generation %} block so trainers can ask
# `apply_chat_template(..., return_assistant_tokens_mask=True)` for loss on assistant tokens only.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, write a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] or '' }}"
    "{%- for tool_call in message['tool_calls'] or [] %}"
    "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{%- if not loop.first or message['content'] %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Training text for the tokenizer: plain English with digits and punctuation, so common words and
# chat-like phrases become single tokens while anything else still encodes through the bytes.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model with random weights cannot answer
questions, but it can still be loaded, batched, served and measured like a large one.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Please summarize the following text in one sentence. Translate this paragraph into French.
The weather this morning was cold and grey, and by noon the rain had turned to snow.
She opened the window, looked at the river, and wrote a long letter to her brother.
In 1969, people walked on the Moon for the first time; in 2024, many more rockets were launched.
The user asked the assistant for help with a recipe: two cups of flour, one egg, a pinch of salt,
three spoons of sugar and a glass of milk. Mix everything, then bake for 25 minutes at 180 degrees.
Our support team answers every ticket within one business day. Thank you for your patience!
Your order #4521 has shipped and should arrive on Tuesday. Track it with the link in your email.
The meeting is moved to Thursday at 3 pm. Please bring the quarterly report and the new budget.
A language model predicts the next token from the tokens before it. Each adapter changes a few
matrices of the model, so one shared base can serve many tenants at once without copying it.
Good morning, everyone. Today we will learn how to read a map, how to use a compass, and how to
find our way back to the camp before dark. Remember to drink water and to stay with your group.
The library opens at nine and closes at six. Children under twelve must be with an adult.
He said, "I don't know where the keys are." She answered, "They're on the table, next to the lamp."
Question: What is the capital of Italy? Answer: Rome. Question: How many days are in a week?
Answer: Seven. Question: What color is the sky on a clear day? Answer: Blue.
The system prompt tells the assistant to be helpful, honest and brief. The user writes a message,
and the assistant replies. Then the user writes again, and the conversation continues.
Prices went up by 3.5% last year, while wages rose by only 2.1%, according to the report.
Write a short poem about the sea. The waves are slow, the light is low, and the gulls fly home.
It was the best of times, it was the worst of times, it was the age of wisdom and of foolishness.
To be or not to be, that is the question. All the world's a stage, and all the men and women
merely players. They have their exits and their entrances, and one man in his time plays many parts.
Error: the file could not be found. Check the path and try again, or contact your administrator.
Step 1: open the settings. Step 2: choose the account tab. Step 3: click save and restart the app.
Dear customer, we are sorry for the delay. Your refund of $42.00 will be processed within a week.
The train leaves from platform 4 at 08:15 and arrives in the city at 10:40, with one stop.
Cats sleep for most of the day, while dogs like to play, run, and walk with their owners outside.
Fresh bread, warm soup, green tea and an apple make a simple and good lunch on a winter day.
The first rule of the project is simple: every test must be able to fail, and none may download.
Once upon a time there was a little house at the edge of the forest, and in it lived an old man
who made clocks. Every morning he wound them all, and every evening they rang together at seven.
Yes. No. Maybe. Sure, I can help with that. Sorry, I do not understand. Could you say it again?
The numbers are 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100 and 1000. The sum of 12 and 30 is 42.
"""


def _train_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # A plain `tokenizer(text)` starts with BOS, as Llama's does; the chat template writes its own
    # BOS and apply_chat_template encodes without special tokens, so chats get exactly one.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    # transformers' tokenizer __init__ takes untyped **kwargs
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, END_OF_TEXT],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=max(size["max_position_embeddings"] for size in SIZES.values()),
    )


def _model_config(arch: str, size: str, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    common = dict(
        SIZES[size],
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        dtype="float32",
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        # Qwen2's q/k/v projections carry biases; LlamaConfig/MistralConfig have none.
        return Qwen2Config(**common, use_sliding_window=False)
    if arch == "qwen3":
        # As Qwen3's real configs: q/k RMSNorm per head, no biases, and a head_dim of its own (Qwen3-0.6B:
        # 16 heads of 128 on a hidden size of 1024), here twice hidden_size / heads.
        heads = common["num_attention_heads"]
        return Qwen3Config(**common, head_dim=2 * common["hidden_size"] // heads, use_sliding_window=False,
                           attention_bias=False)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    return _other_config(arch, common)


def _other_config(arch: str, common: dict[str, Any]) -> PretrainedConfig:
    """Each config as its real model's (named per arch), with lengths scaled to a test's prompts:
    the RoPE context, sliding windows and soft-caps are set where a prompt of a few dozen tokens
    and the random weights' small scores cross them, so a model that ignored them would differ."""
    heads = common["num_attention_heads"]
    if arch == "llama3":
        # Llama 3.1/3.2/3.3: theta 500000 and "llama3" RoPE scaling (factor 8, low 1, high 4) over an
        # original 8192-token context; here 32 tokens, so the scaled frequencies turn within a prompt.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return LlamaConfig(**{k: v for k, v in common.items() if k != "rope_theta"}, rope_parameters=rope)
    if arch == "phi3":
        # Phi-3-mini-4k: fused qkv_proj and gate_up_proj, as many KV heads as heads, a sliding window
        # (2047 of 4096 tokens; here 16), RMSNorm eps 1e-5.
        return Phi3Config(**{**common, "num_key_value_heads": heads, "rms_norm_eps": 1e-5}, sliding_window=16)
    gemma = {**common, "tie_word_embeddings": True, "head_dim": 2 * common["hidden_size"] // heads}
    if arch == "gemma2":
        # Gemma 2: heads wider than hidden / heads (as 9B's), scores scaled by query_pre_attn_scalar
        # ** -0.5 with that scalar hidden / heads (as 27B's), sliding and full layers alternating
        # (window 4096; here 8), attention and final logits soft-capped (50 and 30; here where the
        # random weights' scores and logits lie).
        return Gemma2Config(**gemma, query_pre_attn_scalar=common["hidden_size"] // heads, sliding_window=8,
                            attn_logit_softcapping=0.05, final_logit_softcapping=0.2)
    # Gemma 3 1B: one KV head, q/k norm, five local layers (window 512; here 8) per global one
    # (here one of each), RoPE bases 10000 local and 1000000 global.
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}
    fields = {k: v for k, v in gemma.items() if k not in ("rope_theta", "num_key_value_heads")}
    return Gemma3TextConfig(**fields, num_key_value_heads=1, rope_parameters=rope, query_pre_attn_scalar=gemma["head_dim"],
                            sliding_window=8, layer_types=["sliding_attention", "full_attention"])


def _check_choice(kind: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; choose one of {', '.join(choices)}")


def build_tiny_model(
    out_dir: Path,
    *,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write a random-weight causal LM of `arch` and `size` with its tokenizer to `out_dir`.

    The directory appears whole or not at all (built beside it, then renamed), so concurrent
    builders and crashes never leave a half-written model. An existing non-empty `out_dir` is an
    error unless `overwrite`. Returns `out_dir`.
    """
    _check_choice("arch", arch, ALL_ARCHS)
    _check_choice("size", size, tuple(SIZES))
    out_dir = Path(out_dir)
    if _is_non_empty_dir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} already exists and is not empty; remove it or overwrite")
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer()
    config = _model_config(arch, size, tokenizer)
    # fork_rng keeps the caller's global RNG untouched; the seed alone decides the weights.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # transformers' auto classes are untyped (from_config(config, **kwargs))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]

    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users' processes
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        _publish(staging, out_dir, overwrite=overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _is_non_empty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _publish(staging: Path, out_dir: Path, *, overwrite: bool) -> None:
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    if not out_dir.exists():
        try:
            os.rename(staging, out_dir)
            return
        except OSError:
            if not overwrite:
                raise FileExistsError(f"{out_dir} was created by someone else meanwhile") from None
    # Swap: the old directory moves aside first, so out_dir is never a mix of two builds.
    retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
    os.rename(out_dir, retired / "model")
    os.rename(staging, out_dir)
    shutil.rmtree(retired, ignore_errors=True)


def save_random_peft_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int,
    lora_alpha: int,
    target_modules: Sequence[str],
    seed: int,
    init_scale: float = 0.05,
    base_model_name_or_path: str | None = None,
    use_dora: bool = False,
) -> Path:
    """Save a PEFT LoRA adapter on the model in `base_dir` with seeded, non-zero A and B.

    A ~ N(0, 1/in_features) and B ~ N(0, init_scale²/r), so the adapter's added output B·A·x has an
    RMS of about `scaling · init_scale · rms(x)` whatever the layer sizes: visible in every test
    without swamping the base model. `base_model_name_or_path` overrides what adapter_config.json
    names as the base (PEFT writes the path the base was loaded from). `use_dora` saves a DoRA
    adapter, its magnitudes PEFT's initial ones (the base's row norms) times 1 ± ~0.3, so that
    the magnitude's scale differs from the norm's everywhere. Returns `out_dir`.
    """
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora_config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        use_dora=use_dora,
    )
    model = get_peft_model(base, lora_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if ".lora_A." in name:
                std = 1 / math.sqrt(param.shape[1])
            elif ".lora_B." in name:
                std = init_scale / math.sqrt(r)
            elif ".lora_magnitude_vector." in name:
                param.mul_(1 + 0.3 * torch.randn(param.shape, generator=generator))
                continue
            else:
                continue
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    out_dir = Path(out_dir)
    # No embedding layer is adapted; saying so stops PEFT from looking the base up (on the Hub,
    # for a name that is not a local path) to check whether the vocabulary changed.
    model.save_pretrained(str(out_dir), safe_serialization=True, save_embedding_layers=False)
    if base_model_name_or_path is not None:
        config_path = out_dir / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = base_model_name_or_path
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m serving.engine.tiny",
        description="Build a small random-weight causal LM with its tokenizer (no download).",
    )
    parser.add_argument("out", type=Path, help="directory to write (must not exist or be empty)")
    parser.add_argument("--arch", choices=ALL_ARCHS, default="llama")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace an existing directory")
    args = parser.parse_args(argv)
    try:
        out = build_tiny_model(
            args.out, arch=args.arch, size=args.size, seed=args.seed, overwrite=args.force
        )
    except FileExistsError as exc:
        parser.exit(2, f"error: {exc} (pass --force to replace it)\n")
    config = json.loads((out / "config.json").read_text())
    print(
        f"{out}: {args.arch} {args.size}, hidden {config['hidden_size']}, "
        f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}, seed {args.seed}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
