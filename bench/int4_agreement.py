"""What serving a bf16-trained adapter on an INT4 base costs in agreement, on a real model (issue 41,
item 2): the model's AWQ INT4 checkpoint is written here by plain round-to-nearest, and its answers
are compared with the unquantized base's, with and without the demo adapter.

    OMP_NUM_THREADS=2 python bench/int4_agreement.py var/models/SmolLM2-135M-Instruct --work /tmp/int4-agreement \
        [--adapter DIR] [--dtype bfloat16] [--json OUT.json]

1. **The checkpoint** (``WORK/awq``, :func:`write_rtn_awq`): every decoder projection
   ``kernels.int4.quantize``d (asymmetric min/max per group of input rows, rounded to nearest) and
   packed in AutoAWQ's GEMM layout, the rest of the weights as they are, config.json with the
   ``quantization_config`` bench/awq_checkpoint.py writes, tokenizer and chat template copied: the
   engine loads it as any AWQ checkpoint. This is not AWQ's activation-aware search (which picks
   per-channel scales from calibration activations): the figures are a floor on a real AWQ
   checkpoint's agreement.
2. **The adapter** (``--adapter``, or trained into ``WORK/train/adapter`` unless it is there): the demo
   job's path (scripts/demo_finetune_check.py's ``demo_trainer``, hyperparameters "auto") on the
   unquantized base.
3. **Teacher-forced top-1 agreement**: transformers runs the unquantized model and a copy whose
   projection weights are ``dequantize(quantize(W))`` (:func:`dequantize_projections`, the weights
   the engine's INT4 layer multiplies), the adapter loaded on both with PEFT, over the same token
   sequences: each held-out question with the unquantized engine's greedy answer, and every training
   line. Agreement is the fraction of positions whose argmax is the same, over the answers' positions
   and over all distinct positions (the system prompt every chat template writes counted once).
4. **End to end** (serving.engine's offline ``LLM`` on the CPU): greedy answers (24 tokens) to the six
   held-out questions from the unquantized directory and from the INT4 checkpoint, with the adapter:
   the facts each gives (scripts/demo_finetune_check.py's ``fact_learned``) and how many answers are
   identical word for word; the same without the adapter.

Figures: docs/quantized-bases.md, "Agreement on the demo model".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# Run as a script, this file's folder heads sys.path; the repository root must be there instead.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from peft import PeftModel  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase  # noqa: E402

from bench.awq_checkpoint import awq_layer, save_awq_checkpoint  # noqa: E402
from kernels import int4  # noqa: E402
from scripts.demo_finetune_check import (  # noqa: E402
    Messages,
    demo_hyperparameters,
    demo_trainer,
    fact_learned,
    held_out,
    training_lines,
)
from serving.engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from training.int4_layout import group_size_for  # noqa: E402
from training.trainer import StepMetrics, load_base  # noqa: E402

# The decoder projections an AWQ checkpoint quantizes (q/k/v/o, gate/up/down), by their weights' names.
PROJECTION = re.compile(r"^(model\.layers\.\d+\.(?:self_attn|mlp)\.\w+_proj)\.weight$")
# What a model directory holds besides its weights and config, copied into the checkpoint.
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "generation_config.json")  # fmt: skip
ANSWER_TOKENS = 24  # as scripts/demo_finetune_check.py's answers
AUTO = {"n_epochs": "auto", "batch_size": "auto", "learning_rate": "auto"}  # the dashboard's form left empty


def _progress(stage: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {stage}", file=sys.stderr, flush=True)


def checkpoint_group_size(in_features: Iterable[int]) -> int:
    """One group for every projection (the checkpoint has one ``group_size``): 128, or the largest
    multiple of 16 below it that divides every input size (96 for SmolLM2-135M's 576 and 1536)."""
    group = group_size_for(math.gcd(*in_features))
    if group is None:
        raise ValueError("the projections' input sizes have no common group that is a multiple of 16")
    return group


def rtn_weight(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``dequantize(quantize(W))`` as a torch weight ``[out, in]`` of ``weight``'s dtype: what the
    checkpoint's projection holds, dequantized as the engine's INT4 layer does (one rounding)."""
    return int4.dequantize(*int4.quantize(weight, group_size), group_size, weight.dtype).t().contiguous()


def _projections(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{weight name: prefix}`` of the decoder projections among ``tensors``."""
    return {name: match.group(1) for name in tensors if (match := PROJECTION.match(name))}


def write_rtn_awq(model_dir: Path, out: Path, *, group_size: int | None = None) -> Path:
    """Write ``model_dir``'s AWQ INT4 checkpoint to ``out`` (a new directory): projections rounded to
    nearest by ``kernels.int4.quantize`` (group: ``group_size``, or :func:`checkpoint_group_size`),
    everything else as stored; returns ``out``."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors |= load_file(str(file))
    projections = _projections(tensors)
    if not projections:
        raise ValueError(f"{model_dir} holds no decoder projection named like model.layers.N.self_attn.q_proj.weight")
    group = group_size or checkpoint_group_size(tensors[name].shape[1] for name in projections)
    written: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in projections:
            written |= awq_layer(projections[name], *int4.quantize(tensor, group), group)
        else:
            written[name] = tensor
    config = json.loads((model_dir / "config.json").read_text())
    return save_awq_checkpoint(out, config, written, group_size=group, files_from=model_dir, files=MODEL_FILES)


def dequantize_projections(model: torch.nn.Module, group_size: int) -> None:
    """Replace, in place, every decoder projection's weight of a transformers model by
    :func:`rtn_weight` of it: the unquantized model's twin of the INT4 checkpoint."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if PROJECTION.match(name):
                parameter.copy_(rtn_weight(parameter, group_size))


@dataclass(frozen=True)
class Agreement:
    """Positions whose argmax agree, of how many: over the answers, and over every distinct position
    (a prefix shared by several sequences, the chat template's system prompt, counted once)."""

    answer_agree: int
    answer_positions: int
    all_agree: int
    all_positions: int

    def answer(self) -> float:
        return self.answer_agree / self.answer_positions

    def overall(self) -> float:
        return self.all_agree / self.all_positions


@torch.no_grad()
def top1_agreement(reference: torch.nn.Module, quantized: torch.nn.Module,
                   sequences: Sequence[tuple[list[int], int]]) -> Agreement:  # fmt: skip
    """Teacher-forced agreement over ``(token ids, answer start)`` sequences: at each position the two
    models' argmax of the next token, over the answer's positions (those predicting ``ids[start:]``)
    and over every position whose prefix no earlier sequence had."""
    answer_agree = answer_positions = all_agree = all_positions = 0
    seen: set[tuple[int, ...]] = set()
    for ids, start in sequences:
        batch = torch.tensor([ids])
        same = (reference(batch).logits[0, :-1].argmax(-1) == quantized(batch).logits[0, :-1].argmax(-1)).tolist()
        answer_agree += sum(same[start - 1 :])
        answer_positions += len(ids) - start
        for position, agree in enumerate(same):
            if (prefix := tuple(ids[: position + 1])) not in seen:
                seen.add(prefix)
                all_agree += agree
                all_positions += 1
    return Agreement(answer_agree, answer_positions, all_agree, all_positions)


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> list[int]:
    return tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]  # fmt: skip


def sequences(tokenizer: PreTrainedTokenizerBase, answers: Sequence[list[int]]) -> list[tuple[list[int], int]]:
    """The texts scored: each held-out question followed by ``answers`` (token ids, in order), then
    every training line as its chat template writes it (the answer from the assistant's turn)."""
    out = []
    for messages, answer in zip(held_out(), answers):
        prompt = _prompt_ids(tokenizer, messages)
        out.append((prompt + answer, len(prompt)))
    for line in training_lines():
        messages = json.loads(line)["messages"]
        prompt = _prompt_ids(tokenizer, messages)
        full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        if full[: len(prompt)] != prompt:
            raise ValueError(f"the chat template writes {messages[0]['content']!r} unlike its generation prompt")
        out.append((full, len(prompt)))
    return out


@dataclass(frozen=True)
class Answers:
    """One engine's greedy answers to the held-out questions."""

    texts: list[str]
    token_ids: list[list[int]]

    def facts(self) -> int:
        return sum(fact_learned(messages, text) for messages, text in zip(held_out(), self.texts))


def engine_answers(model_dir: Path, adapter: Path, dtype: str, rank: int) -> tuple[Answers, Answers]:
    """(without the adapter, with it): the engine's greedy answers to the held-out questions."""
    llm = LLM(str(model_dir), device="cpu", dtype=dtype, max_loras=1, max_lora_rank=rank, max_num_seqs=6,
              max_model_len=512)  # fmt: skip
    questions = [messages[:1] for messages in held_out()]
    params = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS)
    result = []
    for lora in (None, LoRARequest("demo", str(adapter))):
        outputs = llm.chat(questions, params, lora_request=lora)
        result.append(Answers([o.outputs[0].text.strip() for o in outputs], [list(o.outputs[0].token_ids) for o in outputs]))
    return result[0], result[1]


class _Quiet:
    """The demo job's hooks with nothing to record but the loss."""

    def should_stop(self) -> bool:
        return False

    def on_step(self, *_: object) -> None: ...

    def on_log(self, metrics: StepMetrics) -> None:
        print(f"  step {metrics.step}/{metrics.total_steps} loss {metrics.train_loss:.3f}", flush=True)

    def on_checkpoint(self, *_: object) -> None: ...


def demo_adapter(model_dir: Path, work: Path) -> Path:
    """The demo job's adapter (hyperparameters "auto") trained on the unquantized base into
    ``work/train/adapter``, or the one already there."""
    adapter = work / "train" / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        shutil.rmtree(work / "train", ignore_errors=True)
        _progress(f"training the demo adapter into {adapter}")
        demo_trainer(load_base(str(model_dir)), demo_hyperparameters(AUTO), _Quiet(), work / "train").run()
    return adapter


def _model(model_dir: Path, dtype: torch.dtype, group_size: int | None, adapter: Path | None) -> torch.nn.Module:
    """The transformers model (fp32 weights, INT4-rounded where ``group_size`` is given, then cast to
    ``dtype``, as the engine casts a checkpoint) with ``adapter`` on it."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if group_size is not None:
        dequantize_projections(model, group_size)
    model = model.to(dtype)  # type: ignore[arg-type]
    return (PeftModel.from_pretrained(model, str(adapter)) if adapter else model).eval()


def measure(model_dir: Path, work: Path, adapter: Path | None, dtype: str) -> dict[str, object]:
    """Every figure of the bench, for the table and ``--json``."""
    awq_dir = work / "awq"
    if not (awq_dir / "config.json").is_file():
        shutil.rmtree(awq_dir, ignore_errors=True)
        _progress(f"writing the INT4 checkpoint {awq_dir}")
        write_rtn_awq(model_dir, awq_dir)
    group = json.loads((awq_dir / "config.json").read_text())["quantization_config"]["group_size"]
    adapter = adapter or demo_adapter(model_dir, work)
    rank = json.loads((adapter / "adapter_config.json").read_text())["r"]
    _progress("the engine on the unquantized base")
    reference_base, reference_tuned = engine_answers(model_dir, adapter, dtype, rank)
    _progress("the engine on the INT4 checkpoint")
    int4_base, int4_tuned = engine_answers(awq_dir, adapter, dtype, rank)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = {}
    for label, lora, reference, quantized in (("base", None, reference_base, int4_base),
                                               ("adapter", adapter, reference_tuned, int4_tuned)):  # fmt: skip
        _progress(f"teacher-forced top-1, {label}")
        agreement = top1_agreement(_model(model_dir, getattr(torch, dtype), None, lora),
                                   _model(model_dir, getattr(torch, dtype), group, lora),
                                   sequences(tokenizer, reference.token_ids))  # fmt: skip
        rows[label] = {
            "top1_answer": agreement.answer(), "top1_all": agreement.overall(), "positions": asdict(agreement),
            "facts_reference": reference.facts(), "facts_int4": quantized.facts(),
            "identical_answers": sum(a == b for a, b in zip(reference.texts, quantized.texts)),
            "answers_reference": reference.texts, "answers_int4": quantized.texts,
        }  # fmt: skip
    return {"model": str(model_dir), "group_size": group, "dtype": dtype, "adapter": str(adapter),
            "questions": len(held_out()), "rows": rows}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a Hugging Face model directory (the demo model)")
    parser.add_argument("--work", type=Path, required=True, help="the INT4 checkpoint and the trained adapter go here")
    parser.add_argument("--adapter", type=Path, help="a PEFT adapter of the model (default: train the demo's)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    started = time.time()
    figures = measure(args.model, args.work, args.adapter, args.dtype) | {"seconds": round(time.time() - started)}
    questions = figures["questions"]
    print(f"{args.model.name}: INT4 (round-to-nearest, group {figures['group_size']}) against the unquantized base, "
          f"{args.dtype} on the CPU")  # fmt: skip
    print(f"{'':8} {'top-1 (answers)':>16} {'top-1 (all)':>12} {'facts unquantized':>18} {'facts INT4':>11} "
          f"{'identical':>10}")  # fmt: skip
    for label, row in figures["rows"].items():  # type: ignore[attr-defined]
        print(f"{label:8} {row['top1_answer']:>16.4f} {row['top1_all']:>12.4f} {row['facts_reference']:>14}/{questions} "
              f"{row['facts_int4']:>8}/{questions} {row['identical_answers']:>7}/{questions}")  # fmt: skip
    for label, row in figures["rows"].items():  # type: ignore[attr-defined]
        for before, after in zip(row["answers_reference"], row["answers_int4"]):
            if before != after:
                print(f"  {label}: {before!r}\n  {' ' * len(label)}  INT4: {after!r}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
