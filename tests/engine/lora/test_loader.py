"""The loader thread's result (serving.engine.lora.loader): an adapter's weights as the pool's rows
want them, in one buffer (pinned on CUDA: one host allocation per adapter, not two per tensor)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from serving.engine.lora.integrity import raw_sum
from serving.engine.lora.loader import AdapterLoader
from serving.engine.lora.reader import load_adapter
from serving.engine.lora.records import LoadResult, PendingLoad

_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _read(base: Path, adapter: Path, *, dtype: torch.dtype, pin: bool) -> LoadResult:
    loader = AdapterLoader(base_config=AutoConfig.from_pretrained(base), base_model_name=None, max_lora_rank=16,
                           dtype=dtype, pin_memory=pin, on_done=lambda: None)  # fmt: skip
    try:
        load = loader.submit(PendingLoad("ad", str(adapter)), start_now=True)
        assert load.future is not None
        return load.future.result(timeout=60)
    finally:
        loader.shutdown()


@pytest.mark.parametrize("pin", [False, pytest.param(True, marks=_CUDA)])
def test_an_adapter_is_one_buffer_of_the_model_dtype_with_b_transposed(
    pin: bool, tiny_llama_dir: Path, make_adapter: Callable[..., Path]
) -> None:
    adapter = make_adapter(tiny_llama_dir, r=8, lora_alpha=16, target_modules=("q_proj", "v_proj", "down_proj"), seed=3,
                           init_scale=0.5)  # fmt: skip
    result = _read(tiny_llama_dir, adapter, dtype=torch.bfloat16, pin=pin)
    reference = load_adapter(adapter, base_config=AutoConfig.from_pretrained(tiny_llama_dir), max_lora_rank=16)

    assert result.weights.keys() == reference.weights.keys()
    storages = set()
    for key, (a, bt) in result.weights.items():
        ref_a, ref_b = reference.weights[key]
        assert a.dtype == bt.dtype == torch.bfloat16 and a.is_contiguous() and bt.is_contiguous()
        assert a.is_pinned() == bt.is_pinned() == pin
        torch.testing.assert_close(a, ref_a.to(torch.bfloat16), rtol=0, atol=0)
        torch.testing.assert_close(bt, ref_b.t().to(torch.bfloat16), rtol=0, atol=0)
        storages |= {a.untyped_storage().data_ptr(), bt.untyped_storage().data_ptr()}
    assert len(storages) == 1, "every tensor is a view of the adapter's one buffer"
    tensors = [t for pair in result.weights.values() for t in pair]
    assert result.nbytes == sum(t.nbytes for t in tensors)
    assert result.checksum == sum(raw_sum(t) for t in tensors), "the buffer's sum is its tensors' sums"
