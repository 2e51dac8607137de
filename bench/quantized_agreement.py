"""What serving a bf16-trained adapter on a quantized base costs in agreement, on a real model:
the INT4 base (issue 41, item 2; the model's AWQ INT4 checkpoint is written here by plain
round-to-nearest) or the FP8 base (issue 38, item 6; the engine's ``quantization="fp8"``), its answers
compared with the unquantized base's, with and without the demo adapter.

    OMP_NUM_THREADS=1 python bench/quantized_agreement.py var/models/SmolLM2-135M-Instruct \
        --work /tmp/quantized-agreement [--quantization {int4,fp8}] [--adapter DIR] [--dtype bfloat16] [--json OUT.json]

1. **The INT4 checkpoint** (``--quantization int4``, the default; ``WORK/awq``, :func:`write_rtn_awq`):
   every decoder projection ``kernels.int4.quantize``d (asymmetric min/max per group of input rows,
   rounded to nearest) and packed in AutoAWQ's GEMM layout, the rest of the weights as they are,
   config.json with the ``quantization_config`` bench/awq_checkpoint.py writes, tokenizer and chat
   template copied: the engine loads it as any AWQ checkpoint. This is not AWQ's activation-aware
   search (which picks per-channel scales from calibration activations): the figures are a floor on a
   real AWQ checkpoint's agreement. The FP8 base needs no checkpoint: the engine quantizes the model
   directory's projections as it loads them (serving.engine.layers.fp8_linear).
2. **The adapter** (``--adapter``, or trained into ``WORK/train/adapter`` unless it is there): the demo
   job's path (scripts/demo_finetune_check.py's ``demo_trainer``, hyperparameters "auto") on the
   unquantized base.
3. **Teacher-forced top-1 agreement** over the same token sequences (:func:`sequences`): each held-out
   question with the unquantized engine's greedy answer, and every training line. Agreement is the
   fraction of positions where the two models' most likely next token is the same, over the answers'
   positions and over all distinct positions (the system prompt every chat template writes counted
   once; :func:`count_agreement`). The two models, each with the adapter or without it:

   - INT4: transformers runs the unquantized model and a copy whose projection weights are
     ``dequantize(quantize(W))`` (:func:`dequantize_projections`, the weights the engine's INT4
     layer multiplies), the adapter loaded on both with PEFT (:func:`top1_agreement`);
   - FP8: the engine itself, unquantized and with ``quantization="fp8"`` (whose layers quantize each
     call's activations per token, which a transformers copy with rounded weights would not do), each
     scoring the sequences through ``prompt_logprobs`` (:func:`engine_scores`). Also counted, as
     tests/engine/test_fp8.py measures it: the answers' positions where the FP8 engine's most likely
     token is the unquantized engine's greedy token, and, as the measure's own check, those where the
     unquantized engine scoring its own answer teacher-forced ranks its greedy token first; and the
     unquantized engine's margin (top-1 minus top-2 log-probability) where the two part ways.
4. **End to end** (serving.engine's offline ``LLM`` on the CPU): greedy answers (24 tokens) to the six
   held-out questions from the unquantized base and from the quantized one, with the adapter: the
   facts each gives (scripts/demo_finetune_check.py's ``fact_learned``) and how many answers are
   identical word for word; the same without the adapter.

Figures: docs/quantized-bases.md, "Agreement on the demo model" (INT4); docs/benchmarks.md (both);
docs/serving-worker.md, "FP8 base weights" (FP8).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
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
from serving.engine import LLM, Logprob, LoRARequest, SamplingParams  # noqa: E402
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


def count_agreement(sequences: Sequence[tuple[list[int], int]], reference: Sequence[Sequence[int]],
                    quantized: Sequence[Sequence[int]]) -> Agreement:  # fmt: skip
    """Agreement over ``(token ids, answer start)`` sequences, given each model's most likely next
    token at every position of each (``reference[i][p]``: after ``ids[: p + 1]``, ``len(ids) - 1`` of
    them): over the answer's positions (those predicting ``ids[start:]``) and over every position whose
    prefix no earlier sequence had."""
    answer_agree = answer_positions = all_agree = all_positions = 0
    seen: set[tuple[int, ...]] = set()
    for (ids, start), ours, theirs in zip(sequences, reference, quantized, strict=True):
        if not len(ours) == len(theirs) == len(ids) - 1:
            raise ValueError(f"{len(ids)} tokens need {len(ids) - 1} predictions, not {len(ours)} and {len(theirs)}")
        same = [a == b for a, b in zip(ours, theirs)]
        answer_agree += sum(same[start - 1 :])
        answer_positions += len(ids) - start
        for position, agree in enumerate(same):
            if (prefix := tuple(ids[: position + 1])) not in seen:
                seen.add(prefix)
                all_agree += agree
                all_positions += 1
    return Agreement(answer_agree, answer_positions, all_agree, all_positions)


@torch.no_grad()
def top1_agreement(reference: torch.nn.Module, quantized: torch.nn.Module,
                   sequences: Sequence[tuple[list[int], int]]) -> Agreement:  # fmt: skip
    """Teacher-forced agreement of two transformers models over ``(token ids, answer start)``
    sequences: at each position the two models' argmax of the next token (:func:`count_agreement`)."""

    def argmax(model: torch.nn.Module, ids: list[int]) -> list[int]:
        return model(torch.tensor([ids])).logits[0, :-1].argmax(-1).tolist()

    return count_agreement(sequences, [argmax(reference, ids) for ids, _ in sequences],
                           [argmax(quantized, ids) for ids, _ in sequences])  # fmt: skip


def top_token(entry: dict[int, Logprob], token: int) -> int:
    """The most likely token at a position of an engine's ``prompt_logprobs`` (asked with 1 or more):
    ``token`` (the text's) where the engine ranks it first, a tie included, else the entry ranked 1."""
    if entry[token].rank == 1:
        return token
    return next(tid for tid, logprob in entry.items() if logprob.rank == 1)


@dataclass(frozen=True)
class Scores:
    """An engine's teacher-forced view of each sequence, one entry a position (``len(ids) - 1``)."""

    top: list[list[int]]  # the most likely next token
    gap: list[list[float]]  # its log-probability minus the second most likely one's


def engine_scores(llm: LLM, sequences: Sequence[tuple[list[int], int]], lora: LoRARequest | None) -> Scores:
    """The engine's most likely next token, and its margin, at every position of each sequence,
    teacher-forced: one prefill a sequence with ``prompt_logprobs`` (which no prefix cache shortens)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids, _ in sequences], params, lora_request=lora)
    tops, gaps = [], []
    for output, (ids, _) in zip(outputs, sequences, strict=True):
        entries = output.prompt_logprobs
        if entries is None or len(entries) != len(ids) or any(entry is None for entry in entries[1:]):
            raise RuntimeError(f"the engine scored {len(entries or [])} of {len(ids)} prompt tokens")
        scored = [(entry, token) for entry, token in zip(entries[1:], ids[1:]) if entry is not None]
        tops.append([top_token(entry, token) for entry, token in scored])
        # The entry holds the two most likely tokens (and the text's, which is less likely or one of them).
        gaps.append([first - second for first, second, *_ in
                     (sorted((lp.logprob for lp in entry.values()), reverse=True) for entry, _ in scored)])  # fmt: skip
    return Scores(tops, gaps)


def answer_gaps(sequences: Sequence[tuple[list[int], int]], reference: Scores,
                quantized: Sequence[Sequence[int]]) -> tuple[list[float], list[float]]:  # fmt: skip
    """``(the reference's gap at every answer position, at those where the quantized model's most
    likely token differs)``."""
    every, parted = [], []
    for (ids, start), top, gap, theirs in zip(sequences, reference.top, reference.gap, quantized, strict=True):
        for position in range(start - 1, len(ids) - 1):
            every.append(gap[position])
            if top[position] != theirs[position]:
                parted.append(gap[position])
    return every, parted


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


def engine(model_dir: Path, dtype: str, rank: int, quantization: str | None = None) -> LLM:
    """The offline engine on the CPU the bench asks (an AWQ checkpoint's ``quantization`` follows its
    config.json)."""
    return LLM(str(model_dir), device="cpu", dtype=dtype, max_loras=1, max_lora_rank=rank, max_num_seqs=6,
               max_model_len=512, quantization=quantization)  # fmt: skip


def engine_answers(llm: LLM, adapter: Path) -> tuple[Answers, Answers]:
    """(without the adapter, with it): the engine's greedy answers to the held-out questions."""
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


def _row(agreement: Agreement, quantization: str, reference: Answers, quantized: Answers) -> dict[str, object]:
    return {
        "top1_answer": agreement.answer(), "top1_all": agreement.overall(), "positions": asdict(agreement),
        "facts_reference": reference.facts(), f"facts_{quantization}": quantized.facts(),
        "identical_answers": sum(a == b for a, b in zip(reference.texts, quantized.texts)),
        "answers_reference": reference.texts, f"answers_{quantization}": quantized.texts,
    }  # fmt: skip


def measure_int4(model_dir: Path, work: Path, adapter: Path, dtype: str) -> dict[str, object]:
    """The INT4 base's figures: the checkpoint written (or the one in ``work/awq``), agreement by
    transformers."""
    awq_dir = work / "awq"
    if not (awq_dir / "config.json").is_file():
        shutil.rmtree(awq_dir, ignore_errors=True)
        _progress(f"writing the INT4 checkpoint {awq_dir}")
        write_rtn_awq(model_dir, awq_dir)
    group = json.loads((awq_dir / "config.json").read_text())["quantization_config"]["group_size"]
    rank = json.loads((adapter / "adapter_config.json").read_text())["r"]
    _progress("the engine on the unquantized base")
    reference_base, reference_tuned = engine_answers(engine(model_dir, dtype, rank), adapter)
    _progress("the engine on the INT4 checkpoint")
    int4_base, int4_tuned = engine_answers(engine(awq_dir, dtype, rank), adapter)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = {}
    for label, lora, reference, quantized in (("base", None, reference_base, int4_base),
                                               ("adapter", adapter, reference_tuned, int4_tuned)):  # fmt: skip
        _progress(f"teacher-forced top-1, {label}")
        agreement = top1_agreement(_model(model_dir, getattr(torch, dtype), None, lora),
                                   _model(model_dir, getattr(torch, dtype), group, lora),
                                   sequences(tokenizer, reference.token_ids))  # fmt: skip
        rows[label] = _row(agreement, "int4", reference, quantized)
    return {"group_size": group, "rows": rows}


def measure_fp8(model_dir: Path, adapter: Path, dtype: str) -> dict[str, object]:
    """The FP8 base's figures: both engines answer and score the same sequences, one engine at a time."""
    rank = json.loads((adapter / "adapter_config.json").read_text())["r"]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    loras = {"base": None, "adapter": LoRARequest("demo", str(adapter))}
    answers: dict[str, dict[str, Answers]] = {}
    scores: dict[str, dict[str, Scores]] = {}
    scored: dict[str, list[tuple[list[int], int]]] = {}
    for side, quantization in (("reference", None), ("fp8", "fp8")):
        _progress(f"the engine on the {'FP8' if quantization else 'unquantized'} base")
        llm = engine(model_dir, dtype, rank, quantization)
        answers[side] = dict(zip(loras, engine_answers(llm, adapter)))
        if not scored:  # the unquantized engine's answers are the texts both score
            scored = {label: sequences(tokenizer, answers[side][label].token_ids) for label in loras}
        _progress("teacher-forced scoring")
        scores[side] = {label: engine_scores(llm, scored[label], lora) for label, lora in loras.items()}
        llm.llm_engine.shutdown()
        del llm
    rows = {}
    for label in loras:
        reference, fp8 = scores["reference"][label], scores["fp8"][label]
        held = scored[label][: len(held_out())]
        text = [ids[1:] for ids, _ in held]  # the held-out answers are the unquantized engine's greedy tokens
        greedy = count_agreement(held, text, fp8.top[: len(held)])
        own = count_agreement(held, text, reference.top[: len(held)])
        every, parted = answer_gaps(scored[label], reference, fp8.top)
        rows[label] = _row(count_agreement(scored[label], reference.top, fp8.top), "fp8",
                           answers["reference"][label], answers["fp8"][label]) | {
            "greedy_top1_fp8": [greedy.answer_agree, greedy.answer_positions],
            "greedy_top1_reference": [own.answer_agree, own.answer_positions],
            "answer_gap_median": statistics.median(every),
            "parted_gaps": sorted(parted),
        }  # fmt: skip
    return {"rows": rows}


def measure(model_dir: Path, work: Path, adapter: Path | None, dtype: str,
            quantization: str = "int4") -> dict[str, object]:  # fmt: skip
    """Every figure of the bench, for the table and ``--json``."""
    adapter = adapter or demo_adapter(model_dir, work)
    if quantization == "int4":
        figures = measure_int4(model_dir, work, adapter, dtype)
    else:
        figures = measure_fp8(model_dir, adapter, dtype)
    return {"model": str(model_dir), "quantization": quantization, "dtype": dtype, "adapter": str(adapter),
            "questions": len(held_out())} | figures  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a Hugging Face model directory (the demo model)")
    parser.add_argument("--work", type=Path, required=True, help="the INT4 checkpoint and the trained adapter go here")
    parser.add_argument("--quantization", default="int4", choices=("int4", "fp8"),
                        help="the quantized base: an AWQ INT4 checkpoint rounded to nearest, or the engine's FP8")
    parser.add_argument("--adapter", type=Path, help="a PEFT adapter of the model (default: train the demo's)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    started = time.time()
    figures = measure(args.model, args.work, args.adapter, args.dtype, args.quantization)
    figures["seconds"] = round(time.time() - started)
    questions = figures["questions"]
    name = "INT4" if args.quantization == "int4" else "FP8"
    how = (f"round-to-nearest, group {figures['group_size']}" if args.quantization == "int4"
           else "e4m3, weights per channel, activations per token")  # fmt: skip
    print(f"{args.model.name}: {name} ({how}) against the unquantized base, {args.dtype} on the CPU")
    print(f"{'':8} {'top-1 (answers)':>16} {'top-1 (all)':>12} {'facts unquantized':>18} {f'facts {name}':>11} "
          f"{'identical':>10}")  # fmt: skip
    for label, row in figures["rows"].items():  # type: ignore[attr-defined]
        print(f"{label:8} {row['top1_answer']:>16.4f} {row['top1_all']:>12.4f} {row['facts_reference']:>14}/{questions} "
              f"{row[f'facts_{args.quantization}']:>8}/{questions} {row['identical_answers']:>7}/{questions}")  # fmt: skip
    for label, row in figures["rows"].items():  # type: ignore[attr-defined]
        positions = row["positions"]
        print(f"{label}: answers {positions['answer_agree']}/{positions['answer_positions']}, "
              f"all {positions['all_agree']}/{positions['all_positions']}")  # fmt: skip
        if args.quantization == "fp8":
            (fp8_agree, fp8_of), (own_agree, own_of) = row["greedy_top1_fp8"], row["greedy_top1_reference"]
            print(f"{label}: the unquantized greedy token is FP8's most likely at {fp8_agree}/{fp8_of} answer "
                  f"positions (the unquantized engine's own most likely at {own_agree}/{own_of})")  # fmt: skip
            parted = row["parted_gaps"]
            parted_median = statistics.median(parted) if parted else 0.0
            print(f"{label}: the unquantized engine's top-2 gap over the answers, median "
                  f"{row['answer_gap_median']:.3f} nats; where FP8's top token differs, largest "
                  f"{max(parted, default=0.0):.3f}, median {parted_median:.3f}")  # fmt: skip
    for label, row in figures["rows"].items():  # type: ignore[attr-defined]
        for before, after in zip(row["answers_reference"], row[f"answers_{args.quantization}"]):
            if before != after:
                print(f"  {label}: {before!r}\n  {' ' * len(label)}  {name}: {after!r}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
