"""The whole journey through `make up`'s processes (the launcher, started by this test): upload a
dataset → train → deploy → first completion through `/v1` with the `openai` client → a canary at
0.5 → promote → rollback, and the usage API shows those requests. Bounded: every wait has a
deadline, and the launcher is stopped whatever happens."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from serving.engine.tiny import save_random_peft_adapter
from tests.lora_platform.test_launcher import Launcher, unused_port, with_demo_model

pytestmark = pytest.mark.e2e

TRAIN_TIMEOUT_S = 400
EXAMPLES = [
    {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                  {"role": "assistant", "content": f"{a + b}."}]}
    for a in range(4) for b in range(4)
]


def wait(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


@pytest.fixture
def platform(tmp_path: Path):
    launcher = Launcher(with_demo_model(tmp_path / "var"), unused_port())
    try:
        launcher.wait_for("Loraplex is up")
        launcher.wait_serving_healthy()
        yield launcher
        assert launcher.terminate() == 0
    finally:
        launcher.kill()


def test_dataset_to_training_to_canary_promote_rollback_through_v1(platform, tmp_path: Path):
    key = re.search(r"Demo API key (lp-\S+)", platform.output).group(1)
    base = f"http://127.0.0.1:{platform.port}"
    api = httpx.Client(base_url=f"{base}/api/v1", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)

    # 1. Dataset, 2. training job, until the version is registered.
    dataset = api.post("/datasets", files={"file": ("train.jsonl", "\n".join(json.dumps(row) for row in EXAMPLES))})
    assert dataset.status_code == 201, dataset.text
    dataset_id = dataset.json()["id"]
    wait(lambda: api.get(f"/datasets/{dataset_id}").json()["status"] in ("ready", "invalid"), 120, "validation")
    assert api.get(f"/datasets/{dataset_id}").json()["status"] == "ready"
    job = api.post("/training-jobs", json={"training_file": dataset_id, "adapter": "journey-bot", "seed": 1,
                                           "hyperparameters": {"n_epochs": 1, "batch_size": 4, "r": 8}})
    assert job.status_code == 201, job.text
    job_id = job.json()["id"]
    finished = wait(lambda: (body := api.get(f"/training-jobs/{job_id}").json())["status"] in
                    ("succeeded", "failed", "cancelled") and body, TRAIN_TIMEOUT_S, "training")
    assert finished["status"] == "succeeded", finished
    assert finished["fine_tuned_model"] == "journey-bot@1.0.0"

    # 3. Deploy, 4. the first completion through the gateway, by the name training reported too.
    assert api.post("/adapters/journey-bot/versions/1.0.0/deploy", json={}).status_code == 200
    time.sleep(0.6)  # past the gateway's caches (GATEWAY_CACHE_SECONDS, 0.5 s)
    served: list[str] = []

    def ask(model: str = "journey-bot") -> openai.types.chat.ChatCompletion:
        raw = client.chat.completions.with_raw_response.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": "What is 1 plus 2?"}])
        served.append(raw.headers["x-loraplex-adapter-version"])
        reply = raw.parse()
        assert reply.model == model and reply.usage.total_tokens > 0
        return reply

    ask()
    ask(finished["fine_tuned_model"])
    assert served == ["1.0.0", "1.0.0"]
    assert "journey-bot" in {model.id for model in client.models.list()}

    # 5. A second version (uploaded, PEFT format) as a canary at 0.5.
    upload = save_random_peft_adapter(tmp_path / "var" / "models" / "tiny-llama", tmp_path / "v2", r=8,
                                      lora_alpha=16, target_modules=("q_proj", "v_proj"), seed=5, init_scale=0.5)
    files = [("files", (name, (upload / name).read_bytes())) for name in ("adapter_config.json",
                                                                         "adapter_model.safetensors")]
    created = api.post("/adapters/journey-bot/versions", files=files, data={"version": "1.1.0"})
    assert created.status_code == 201, created.text
    assert api.post("/adapters/journey-bot/canary", json={"version": "1.1.0", "weight": 0.5}).status_code == 200
    time.sleep(0.6)
    served.clear()
    for _ in range(24):  # until both have answered: all 24 on one version would be a 1-in-8-million chance
        ask()
        if set(served) == {"1.0.0", "1.1.0"}:
            break
    assert set(served) == {"1.0.0", "1.1.0"}
    canary_asks = len(served)

    # 6. Promote: everything on 1.1.0. 7. Rollback: everything back on 1.0.0.
    assert api.post("/adapters/journey-bot/canary/promote", json={}).status_code == 200
    time.sleep(0.6)
    served.clear()
    for _ in range(6):
        ask()
    assert set(served) == {"1.1.0"}
    assert api.post("/adapters/journey-bot/rollback", json={}).status_code == 200
    time.sleep(0.6)
    served.clear()
    for _ in range(6):
        ask()
    assert set(served) == {"1.0.0"}

    # 8. The usage API counts every one of those requests. A reply's record is queued once its last
    # byte is sent, so the last replies' records may land a moment after the client has them (on a
    # loaded machine a slow Redis round trip keeps them in the process until it is back, then the
    # backlog's pusher sends them): read until they are counted.
    def counted() -> dict | None:
        usage = api.get("/usage", params={"group_by": "adapter"}).json()
        return usage if usage["complete"] and usage["totals"]["requests"] >= asked else None

    asked = 2 + canary_asks + 6 + 6
    usage = wait(counted, 30, "the usage records")
    rows = {row["adapter"]: row for row in usage["data"]}
    assert rows["journey-bot"]["requests"] == asked
    assert usage["totals"]["requests"] == asked
