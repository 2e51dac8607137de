"""The base model's tokenizer, loaded once per process: validation's token statistics and the
trainer's encoding use the same one (training.trainer re-exports it).

A module of its own so that validating a dataset loads transformers without the trainer's PEFT
and the rest of its stack: the `quick` worker's pool processes import it on their first file (the
worker no longer imports the trainer before its pool forks; docs/training.md, "Running workers"),
and this is about 1.5 s of CPU less for that file.
"""

from __future__ import annotations

from functools import lru_cache

from transformers import AutoTokenizer, PreTrainedTokenizerBase


@lru_cache(maxsize=2)
def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the base model directory `path`, loaded once per process and path."""
    return AutoTokenizer.from_pretrained(path)
