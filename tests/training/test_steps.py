"""A step's passes (training.steps) on a stub language model: what a step reports, and that it leaves
its numbers on the device rather than reading them (each read makes the host wait for the GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from training.examples import IGNORE_INDEX, EncodedExample
from training.hyperparameters import Hyperparameters
from training.packing import layout, target_logprobs
from training.steps import StepOutcome, summed_outcomes, train_step

VOCAB = 40


class Stub(torch.nn.Module):
    """An embedding and an output layer: a language model with no code of its own that reads the device."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator))

    def forward(self, input_ids: torch.Tensor, **_: object) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(self.embed(input_ids)))


def items() -> list[EncodedExample]:
    """Sequences of 5 to 15 tokens whose first two tokens are prompt (not trained)."""
    generator = torch.Generator().manual_seed(1)
    made = []
    for length in (5, 9, 12, 7, 15, 6):
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        made.append(EncodedExample(input_ids=ids, labels=[IGNORE_INDEX] * 2 + ids[2:], full_length=length,
                                   truncated=False))
    return made


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_a_step_reports_the_mean_loss_and_the_argmax_hits_of_its_tokens(packing):
    model = Stub()
    hp = Hyperparameters(batch_size=6, gradient_accumulation_steps=3, packing=packing, max_seq_length=32)
    outcome = train_step(model, items(), hp, pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        rows = layout(items(), pad_id=0, device=torch.device("cpu"), packed=False, capacity=32)
        logits = model(rows.input_ids).logits
        logprobs, trained = target_logprobs(logits, rows)
        hits = (logits[:, :-1].argmax(dim=-1) == rows.labels[:, 1:]) & trained
    loss, correct, counted = summed_outcomes([outcome])
    assert counted == int(trained.sum()) == sum(len(item.input_ids) - 2 for item in items())
    assert loss == pytest.approx(-float((logprobs * trained).sum()) / counted, rel=1e-6)
    assert correct == int(hits.sum()) > 0
    # Steps add up as numbers read one by one would: their mean losses, their counts.
    twice = summed_outcomes([outcome, StepOutcome(outcome.sums * 2, outcome.denominator * 4)])
    assert twice == (loss + loss / 2, 3 * correct, 3 * counted)
    assert summed_outcomes([]) == (0.0, 0, 0)


class DeviceReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host: `.item()`, `int()`, `float()`, `bool()` (on a GPU
    each waits for the queued work to finish) and `.tolist()` (which does not dispatch on the CPU)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.reads: list[str] = []
        tolist = torch.Tensor.tolist

        def counted_tolist(tensor: torch.Tensor) -> object:
            self.reads.append("tolist")
            return tolist(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_a_step_reads_nothing_off_the_device(packing, monkeypatch):
    model = Stub()
    hp = Hyperparameters(batch_size=6, gradient_accumulation_steps=2, packing=packing, max_seq_length=32)
    batch = items()
    with DeviceReads(monkeypatch) as reads:
        outcome = train_step(model, batch, hp, pad_id=0, device=torch.device("cpu"))
    assert reads.reads == []
    assert isinstance(outcome.sums, torch.Tensor) and outcome.sums.dtype == torch.float64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_on_cuda_steps_and_optimizer_steps_never_wait_for_the_gpu(packing):
    """The trainer's loop (training.trainer) between two logs: the step's passes (layout copied from
    pinned memory, loss and counts left on the device), clipping and fused AdamW, with no synchronising
    call; the numbers are read after, once."""
    device = torch.device("cuda")
    model = Stub().to(device)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    hp = Hyperparameters(batch_size=6, gradient_accumulation_steps=2, packing=packing, max_seq_length=32)
    batch, outcomes = items(), []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            outcomes.append(train_step(model, batch, hp, pad_id=0, device=device))
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loss, correct, counted = summed_outcomes(outcomes)
    assert counted == 3 * sum(len(item.input_ids) - 2 for item in items()) and loss > 0 and correct >= 0
