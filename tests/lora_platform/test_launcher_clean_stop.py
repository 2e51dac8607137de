"""`make up` stopped with Ctrl-C while a training job runs, then started again on the same var/: the
stop is clean (nothing is killed), the job is left interrupted with its lease released and its
checkpoint recorded, the next start resumes it at once, and the embedded Redis keeps its data in
one file (no `var/redis-<pgid>.rdb` per run).

The training lease is 600 s here: a resumption within the test's wait can only come from the
released lease and the task the stop sent again, never from the lease's expiry. The seconds from
the second start's banner to the resumption are printed."""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from tests.lora_platform.test_launcher import Launcher, unused_port

LEASE_SECONDS = 600
RESUME_WAIT_S = 120
QA = [("What is the capital of Italy?", "Rome."), ("How many days are in a week?", "Seven."),
      ("Say hello.", "Hello! How are you today?"), ("What is 12 plus 30?", "42.")]


def dataset() -> bytes:
    rows = [{"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
            for _ in range(8) for question, answer in QA]
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def stop(launcher: Launcher) -> None:
    """A launcher left running by a failed assertion is stopped with its children, not orphaning them."""
    if launcher.process.poll() is None:
        launcher.terminate()
    launcher.kill()


def job_row(var: Path, job_id: int) -> sqlite3.Row:
    with sqlite3.connect(var / "db.sqlite3") as database:
        database.row_factory = sqlite3.Row
        return database.execute("SELECT status, lease_token, interrupted_at, step FROM training_trainingjob "
                                "WHERE id = ?", (job_id,)).fetchone()


def test_ctrl_c_interrupts_the_training_job_cleanly_and_the_next_start_resumes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    var = tmp_path / "var"
    # The launcher's children inherit these; no periodic checkpoint falls within the run.
    for name, value in {"TRAINING_LEASE_SECONDS": LEASE_SECONDS, "TRAINING_CHECKPOINT_EVERY_STEPS": 100_000,
                        "TRAINING_LOG_EVERY_STEPS": 1, "OMP_NUM_THREADS": 1}.items():
        monkeypatch.setenv(name, str(value))
    first = Launcher(var, unused_port())
    try:
        first.wait_for("Loraplex is up")
        key = re.search(r"Demo API key (lp-\S+)", first.output).group(1)
        api = httpx.Client(base_url=f"http://127.0.0.1:{first.port}/api/v1",
                           headers={"Authorization": f"Bearer {key}"}, timeout=30)
        dataset_id = api.post("/datasets", files={"file": ("train.jsonl", dataset())}).json()["id"]
        wait_for(lambda: api.get(f"/datasets/{dataset_id}").json()["status"] == "ready", 120, "validation")
        created = api.post("/training-jobs", json={
            "training_file": dataset_id, "adapter": "ctrl-c", "seed": 1,
            "hyperparameters": {"n_epochs": 50, "batch_size": 1, "learning_rate": 1e-3}})
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        wait_for(lambda: api.get(f"/training-jobs/{job_id}").json()["progress"]["step"] >= 3, 180, "training")
        api.close()

        first.process.send_signal(signal.SIGINT)  # Ctrl-C
        assert first.process.wait(timeout=90) == 0
        first._reader.join(timeout=10)
    finally:
        stop(first)
    assert "Loraplex stopped." in first.output
    assert "did not stop within" not in first.output and "killing" not in first.output, first.output[-3000:]
    row = job_row(var, job_id)
    assert row["status"] == "running" and row["lease_token"] == "" and row["interrupted_at"] is not None

    # One data file for the embedded Redis, and none per run beside it.
    assert sorted(path.name for path in (var / "redis").iterdir() if not path.name.endswith(".settings")) == [
        "appendonly.aof"]
    assert list(var.glob("redis-*")) == []

    started = time.monotonic()
    second = Launcher(var, unused_port())
    try:
        second.wait_for("Loraplex is up")
        up = time.monotonic()
        api = httpx.Client(base_url=f"http://127.0.0.1:{second.port}/api/v1",
                           headers={"Authorization": f"Bearer {key}"}, timeout=30)
        events = lambda: [event["message"] for event in api.get(f"/training-jobs/{job_id}/events",
                                                                 params={"limit": 100}).json()["data"]]
        stopped = wait_for(lambda: [m for m in events() if m.startswith("The worker stopped at step")], 10, "event")
        step = int(re.search(r"step (\d+)", stopped[0]).group(1))
        wait_for(lambda: f"Resuming from the checkpoint of step {step}." in events(), RESUME_WAIT_S, "the resumption")
        print(f"resumed {time.monotonic() - started:.1f} s after the second start began "
              f"({time.monotonic() - up:.1f} s after its banner)")
        timeline = {event["message"][:40]: event["created_at"] for event in api.get(
            f"/training-jobs/{job_id}/events", params={"limit": 100}).json()["data"]
            if event["type"] == "message"}
        print("events:", json.dumps(timeline, indent=1))
        body = wait_for(lambda: (lambda b: b if b["progress"]["step"] > step else None)(
            api.get(f"/training-jobs/{job_id}").json()), 60, "a step after the checkpoint")
        assert body["status"] == "running" and body["interrupted"] is None and body["attempts"] == 2
        api.close()
        assert second.terminate() == 0
    finally:
        stop(second)
    assert "did not stop within" not in second.output and "killing" not in second.output
