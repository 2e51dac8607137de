"""Does the platform's trainer, on the demo's dataset, change the demo model's answers? (issue 39, item 2)

    OMP_NUM_THREADS=1 .venv/bin/python scripts/demo_finetune_check.py /tmp/smollm2-demo '{}'
    OMP_NUM_THREADS=1 .venv/bin/python scripts/demo_finetune_check.py /tmp/smollm2-demo \
        '{"n_epochs": "auto", "batch_size": "auto", "learning_rate": "auto"}'

(model directory, the job's hyperparameters as the API takes them, "{}" being a dashboard job with
every field left empty). The job's own path: resolve_hyperparameters, fit_to_dataset for "auto"
(the rule in docs/training.md), the dataset's lines encoded as a job encodes them
(training.methods.encode_lines) and training.trainer.LoraTrainer with the platform's checkpointing
hook. At the end of each epoch, greedy answers to examples/demo-facts-held-out.jsonl (questions
phrased unlike any training line) beside the base model's, and how many held-out facts the adapter
gives. Minutes on a CPU, so not in the suite. Figures: docs/training.md, "The demo dataset".

The same path is importable (run from the repository root): `demo_hyperparameters`, `demo_trainer`
(the trainer whose run() leaves the adapter in `work_dir/adapter`), `held_out` and `fact_learned`;
bench/quantized_agreement.py trains its adapter with them.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from training.hyperparameters import Hyperparameters, Limits, fit_to_dataset, from_openai, resolve_hyperparameters
from training.methods import encode_lines
from training.trainer import LoadedBase, LoraTrainer, StepMetrics, TrainingHooks, load_base

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# The word of each held-out answer that says the fact was learned (the base model knows none).
FACT_WORDS = ("2019", "Marlowe", "Wren-7", "Pip", "340", "Lift what matters")
# The platform's default limits (settings' MAX_LORA_RANK 64); no Django here.
LIMITS = Limits(max_rank=64, max_seq_length=4096)
Messages = list[dict[str, str]]


def training_lines() -> list[bytes]:
    return (EXAMPLES / "demo-facts.jsonl").read_bytes().splitlines()


def held_out() -> list[Messages]:
    """The held-out conversations: a question and the answer that states its fact."""
    return [json.loads(line)["messages"] for line in (EXAMPLES / "demo-facts-held-out.jsonl").read_text().splitlines()]


def fact_learned(messages: Messages, answer: str) -> bool:
    """Whether `answer` to the held-out question `messages[0]` gives its fact."""
    return any(word in answer for word in FACT_WORDS if word in messages[1]["content"])


def demo_hyperparameters(raw: dict[str, object]) -> Hyperparameters:
    """A job's hyperparameters (as the API takes them) resolved for the demo dataset."""
    return fit_to_dataset(resolve_hyperparameters(from_openai(raw), LIMITS), len(training_lines()), LIMITS)


def demo_trainer(base: LoadedBase, hp: Hyperparameters, hooks: TrainingHooks, work_dir: Path) -> LoraTrainer:
    """The demo job's trainer, checkpointing at the end of every epoch; its run() saves the adapter
    in `work_dir / "adapter"`."""
    items = encode_lines(training_lines(), "chat", hp, base.tokenizer)
    trainer = LoraTrainer(base, hp, seed=0, train=items, valid=[], hooks=hooks, work_dir=work_dir,
                          fingerprint="demo", base_model_name="demo", checkpoint_every=0, log_every=1)
    trainer.checkpoint_every = trainer.plan.steps_per_epoch
    return trainer


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model_dir, raw = sys.argv[1], json.loads(sys.argv[2])
    hp = demo_hyperparameters(raw)
    print("hyperparameters", json.dumps({k: v for k, v in hp.to_dict().items()
                                         if k in ("n_epochs", "batch_size", "learning_rate", "r", "lora_alpha")}))
    base = load_base(model_dir)
    tok = base.tokenizer
    held = held_out()

    def plain() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def answers(model: torch.nn.Module) -> list[str]:
        out = []
        for messages in held:
            prompt = torch.tensor([tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"]])
            with torch.no_grad():
                ids = model.generate(prompt, max_new_tokens=24, do_sample=False)
            out.append(tok.decode(ids[0][prompt.shape[1]:], skip_special_tokens=True).strip())
        return out

    base_answers = answers(plain())
    started = time.time()

    def report(step: int, directory: Path) -> None:
        train_s = time.time() - started
        tuned = answers(PeftModel.from_pretrained(plain(), directory).eval())
        right = 0
        for messages, before, after in zip(held, base_answers, tuned):
            learned = fact_learned(messages, after)
            right += learned
            print(json.dumps({"q": messages[0]["content"], "base": before, "tuned": after, "fact_learned": learned}))
        print(f"step {step} ({step / trainer.plan.steps_per_epoch:g} epochs) train_s={train_s:.0f} "
              f"held-out facts {right}/{len(held)}", flush=True)

    class Hooks:
        """Every epoch's checkpoint: the held-out answers of the adapter it holds."""

        def should_stop(self) -> bool:
            return False

        def on_step(self, *_: object) -> None: ...

        def on_log(self, metrics: StepMetrics) -> None:
            print("log", json.dumps(metrics.to_dict()), flush=True)

        def on_checkpoint(self, step: int, directory: Path, metrics: dict) -> None:
            report(step, directory)

    with tempfile.TemporaryDirectory() as work:
        trainer = demo_trainer(base, hp, Hooks(), Path(work))
        result = trainer.run()
        report(result.steps, result.adapter_dir)


if __name__ == "__main__":
    main()
