"""What PEFT generates greedily for one prompt alone with its adapter: the engine tests' oracle.

Greedy decoding is only defined up to ties: where PEFT's two best logits are within ``TIE`` of each
other, fp32 summation order alone can pick either, so from that step on either continuation is
accepted (and the comparison stops there, since the two runs then see different contexts).

A model whose config soft-caps the attention scores (Gemma 2) is loaded with transformers' eager
attention: SDPA has no soft-cap, and transformers 5.17 (the GPU machine's) loads Gemma 2 with SDPA
by default, silently dropping the cap (5.24 refuses SDPA for it), so the oracle changed with the
installed transformers and disagreed with the engine on the H200 alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

TIE = 1e-4


@dataclass
class Reference:
    token_ids: list[int]
    logits: list[torch.Tensor]  # one [vocab] row per generated token


class PeftReference:
    """A PEFT model holding every adapter of a test, generating one prompt at a time."""

    def __init__(self, base_dir: Path, adapters: dict[str, Path]) -> None:
        capped = getattr(AutoConfig.from_pretrained(base_dir), "attn_logit_softcapping", None) is not None
        attention = {"attn_implementation": "eager"} if capped else {}
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, **attention)
        self.model = base
        names = list(adapters)
        if names:
            self.model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
            for name in names[1:]:
                self.model.load_adapter(str(adapters[name]), adapter_name=name)
        self.model.eval()

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], adapter: str | None, max_new_tokens: int) -> Reference:
        ids = torch.tensor([prompt_ids])
        kwargs = dict(
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
        if adapter is None:
            if isinstance(self.model, PeftModel):
                with self.model.disable_adapter():
                    out = self.model.generate(input_ids=ids, **kwargs)
            else:
                out = self.model.generate(input_ids=ids, **kwargs)
        else:
            self.model.set_adapter(adapter)
            out = self.model.generate(input_ids=ids, **kwargs)
        return Reference(out.sequences[0, len(prompt_ids) :].tolist(), [row[0].float() for row in out.logits])


def assert_greedy_match(ours: list[int], ref: Reference, what: str) -> None:
    """``ours`` equals PEFT's tokens, except that a near-tie lets the two part ways."""
    assert len(ours) == len(ref.token_ids), f"{what}: {len(ours)} tokens, PEFT made {len(ref.token_ids)}"
    for step, (mine, theirs) in enumerate(zip(ours, ref.token_ids)):
        if mine == theirs:
            continue
        top = ref.logits[step].topk(2)
        tied = float(top.values[0] - top.values[1]) <= TIE and mine in top.indices.tolist()
        assert tied, (
            f"{what}: token {step} is {mine}, PEFT chose {theirs} (logit gap "
            f"{float(top.values[0] - top.values[1]):.2e}, not a tie)\nours {ours}\nPEFT {ref.token_ids}"
        )
        return
