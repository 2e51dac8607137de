"""bench/card.py: the card a bench JSON records, the bandwidth its floor divides by, and the 8B
decode floor of bench/engine.py at a card's bandwidth (issue 38, item 7)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench.card import bandwidth_figures, card, copy_bandwidth, spec_bandwidth
from bench.engine import decode_floor_ms
from bench.random_adapters import LLAMA3_8B


@pytest.mark.parametrize(("name", "bandwidth"), [
    ("NVIDIA H100 80GB HBM3", 3.35e12),
    ("NVIDIA H100 PCIe", 2.0e12),
    ("NVIDIA H100 NVL", 3.9e12),
    ("NVIDIA H200", 4.8e12),
    ("NVIDIA A100-SXM4-80GB", 2.039e12),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_the_datasheet_bandwidth_is_the_named_cards(name: str, bandwidth: float | None) -> None:
    assert spec_bandwidth(name) == bandwidth


def test_the_8b_floor_is_the_cards_not_the_h200s() -> None:
    """The issue's figures: 5.77 ms at the H100's 3.35 TB/s, where 4.8 TB/s gave 4.03 ms on any card."""
    hidden, kv, inter, layers = (LLAMA3_8B[k] for k in ("hidden_size", "num_key_value_heads", "intermediate_size",
                                                         "num_hidden_layers"))
    projections = layers * hidden * (2 * hidden + 2 * kv * 128 + 3 * inter)
    weights = 2 * (projections + LLAMA3_8B["vocab_size"] * hidden)  # bf16
    assert decode_floor_ms(weights, 64, 512, 3.35e12) == pytest.approx(5.77, abs=0.01)
    assert decode_floor_ms(weights, 64, 512, 4.8e12) == pytest.approx(4.03, abs=0.01)


@pytest.mark.slow
def test_a_copy_is_measured_and_bad_sizes_are_refused() -> None:
    measured = copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, repeats=2)
    assert math.isfinite(measured) and measured > 0
    with pytest.raises(ValueError, match="nbytes >= 2"):
        copy_bandwidth(torch.device("cpu"), nbytes=1)
    assert set(bandwidth_figures(torch.device("cpu"))) == {"copy_bandwidth_tb_s"}  # no datasheet for a CPU


def test_the_card_record_names_the_device_and_versions_and_is_json() -> None:
    record = json.loads(json.dumps(card()))
    assert record["torch"] == torch.__version__ and record["host_cpus"] >= 1 and record["host_memory_gib"] > 0
    if torch.cuda.is_available():
        assert record["type"] == "cuda" and record["name"] == torch.cuda.get_device_name(0)
        assert record["memory_gib"] > 0 and record["compute_capability"]
    else:
        assert record["type"] == "cpu" and record["name"]
