"""Tenant B's time to first token, in engine steps, alone and beside tenant A's flood, with the
engine's fairness between tenants (serving.engine.fairness) off and on.

The tiny CPU engine, driven step by step: A queues ``--flood`` requests at once, B sends one
request every 4 steps (20 in all); each request has a 32-token (A) or 8-token (B) prompt and
generates 16 tokens; ``max_num_seqs`` 8. Steps, not seconds: the counts are the scheduler's
decisions, the same on any machine.

    python bench/engine_fairness.py [--flood 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serving.engine import LLM, SamplingParams  # noqa: E402
from serving.engine.tiny import build_tiny_model  # noqa: E402

B_REQUESTS, B_EVERY = 20, 4


def b_ttft_steps(model: Path, flood: int, weights: tuple[int, int]) -> list[int]:
    """Steps from each of B's requests' arrival to the step that gave its first token."""
    llm = LLM(str(model), max_loras=0, device="cpu", max_num_seqs=8, max_model_len=128, num_kv_blocks=512,
              fairness_prompt_weight=weights[0], fairness_output_weight=weights[1])
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for i in range(flood):
        engine.add_request(f"a{i}", {"prompt_token_ids": list(range(5, 37)), "cache_salt": "tenant-a"}, params)
    arrived: dict[str, int] = {}
    first: dict[str, int] = {}
    step = 0
    while len(first) < B_REQUESTS:
        if step % B_EVERY == 0 and len(arrived) < B_REQUESTS:
            name = f"b{len(arrived)}"
            engine.add_request(name, {"prompt_token_ids": list(range(40, 48)), "cache_salt": "tenant-b"}, params)
            arrived[name] = step
        for output in engine.step():
            if output.request_id in arrived and output.request_id not in first:
                first[output.request_id] = step
        step += 1
    return [first[name] - arrived[name] for name in arrived]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny", arch="llama", seed=0)
        for label, flood, weights in (("B alone", 0, (1, 2)),
                                      (f"A floods {args.flood}, fairness off", args.flood, (0, 0)),
                                      (f"A floods {args.flood}, fairness on", args.flood, (1, 2))):
            steps = sorted(b_ttft_steps(model, flood, weights))
            print(f"{label}: B's TTFT in steps p50 {statistics.median(steps):g}, max {steps[-1]}")


if __name__ == "__main__":
    main()
