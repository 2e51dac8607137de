"""A job on several GPUs, here two ranks over gloo on the CPU (docs/training.md, "Several GPUs").

Rank 0 is this test's process, as it is the Celery task's; rank 1 is the subprocess
training.distributed starts. FSDP2 shards the tiny base over both. Two ranks give the adapter one
process gives for the same global batch (to float rounding: the ranks' gradients are summed in
another order), supervised and DPO (packed, with gradient checkpointing); a two-rank run that dies after its step-3 checkpoint leaves no rank behind and,
resumed at two ranks, ends with the uninterrupted two-rank run's adapter, and at one rank with it
to rounding (a checkpoint resumes at any world size); a pause asked of rank 0 stops both at its
checkpoint, resumed exactly. Through the services, a job asking for two
GPUs runs in the Celery task's body and publishes its version; on a real Celery worker killed
mid-job, its rank 1 dies with it and the next worker resumes the job from its checkpoint; the
tier's max_gpus_per_job refuses more with a 400 that names it.

Dropout is off in the comparisons with one process: its masks are drawn per rank.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tenants.models import Tier
from tests import zygote
from training import concurrency, datasets, distributed, jobs, run
from training.examples import Example, encode_example
from training.hyperparameters import DPO, Hyperparameters
from training.preference import encode, iter_valid_pairs
from training.models import Checkpoint, Dataset, TrainingEvent, TrainingJob
from training.ranks import RunInputs, trainer_base
from training.trainer import TrainingInterrupted, load_tokenizer
from test_dpo import preference_lines, raw
from training_support import QA, chat_lines, jsonl, wait_for

pytestmark = pytest.mark.e2e

# 8 examples in batches of 3 (3, 3, 2 a step), each step's share in micro-batches of one: rank 1 is
# an example short in the steps of 3, so it runs a zero-weight pass to match rank 0's all-gathers.
HP = Hyperparameters(n_epochs=2, batch_size=3, gradient_accumulation_steps=3, learning_rate=1e-2,
                     max_seq_length=128, r=4, lora_alpha=8, lora_dropout=0.0)


@pytest.fixture(autouse=True)
def one_thread_ranks(monkeypatch, one_thread) -> None:
    # Rank 1 inherits the environment; one OpenMP thread each on the shared 2-core machine.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _rank_popen(args, *, env, **options):
    """training.distributed's `subprocess.Popen` for the ranks this test process launches: forked
    from the zygote (tests/zygote.py) instead of started cold, 4 s of CPU a rank spent importing
    torch, transformers and peft. The rest is as launched: `python -m training.ranks`, its
    environment, working directory and session. Its parent is the zygote, so that is the process
    it checks it was started by and dies with (the zygote leaves with this test process); the
    Celery worker's ranks (the killed-worker test) are still started cold, by the worker itself."""
    if os.environ.get(zygote.ENABLED_VAR) == "0":
        return subprocess.Popen(args, env=env, **options)
    return zygote.popen(args, env={**env, distributed.ENV_PARENT: str(zygote.zygote_pid(env))}, **options)


@pytest.fixture(autouse=True)
def ranks_forked(monkeypatch) -> None:
    # A namespace of its own: patching the subprocess module itself would reach every caller's Popen.
    monkeypatch.setattr(distributed, "subprocess",
                        SimpleNamespace(Popen=_rank_popen, TimeoutExpired=subprocess.TimeoutExpired))


@pytest.fixture(scope="module")
def inputs(base_model_dir) -> RunInputs:
    tokenizer = load_tokenizer(str(base_model_dir))
    examples = [encode_example(Example(format="chat", messages=(
        {"role": "user", "content": question, "weight": 1},
        {"role": "assistant", "content": answer, "weight": 1})), tokenizer) for question, answer in QA]
    return RunInputs(base_path=str(base_model_dir), hyperparameters=HP.to_dict(), seed=5, train=examples,
                     valid=examples[:2], fingerprint="data-v1", base_model_name="tiny-llama", checkpoint_every=3,
                     log_every=2)


class Hooks:
    """Rank 0's hooks: checkpoints kept, and a crash of the worker after `fail_after` steps."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.keep = Path(tempfile.mkdtemp(prefix="ckpt-"))
        self.fail_after = fail_after
        self.checkpoints: dict[int, Path] = {}
        self.losses: list[float] = []

    def should_stop(self) -> bool:
        return False

    def on_step(self, step: int, total_steps: int, epoch: float, trained_tokens: int) -> None:
        if self.fail_after is not None and step > self.fail_after:
            raise RuntimeError("worker lost")

    def on_log(self, metrics) -> None:
        self.losses.append(metrics.train_loss)

    def on_checkpoint(self, step: int, directory: Path, metrics: dict) -> None:
        self.checkpoints[step] = shutil.copytree(directory, self.keep / f"checkpoint-{step}")


def train(inputs: RunInputs, size: int, work_dir: Path, hooks: Hooks, resume_from: Path | None = None,
          ranks: list | None = None, **options):
    """A run of `size` ranks; `ranks` receives the other ranks' processes (ended once this returns or raises)."""
    with trainer_base(inputs, size) as (base, world):
        if world is not None and ranks is not None:
            ranks.extend(world.children)
        return inputs.trainer(base, hooks, work_dir, world, **options).run(resume_from=resume_from)


def weights(result) -> dict[str, torch.Tensor]:
    return load_file(result.adapter_dir / "adapter_model.safetensors")


def assert_close(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def two_ranks(inputs, tmp_path_factory):
    """An uninterrupted two-rank run (its result and its hooks)."""
    hooks = Hooks()
    return train(inputs, 2, tmp_path_factory.mktemp("two"), hooks), hooks


def test_two_ranks_train_the_adapter_one_process_trains(inputs, two_ranks, tmp_path):
    one_hooks = Hooks()
    one = train(inputs, 1, tmp_path / "one", one_hooks)
    two, two_hooks = two_ranks
    assert two.steps == one.steps == 6 and two.trained_tokens == one.trained_tokens
    assert sorted(two_hooks.checkpoints) == sorted(one_hooks.checkpoints) == [3]
    assert two_hooks.losses == pytest.approx(one_hooks.losses, rel=1e-4)
    expected = weights(one)
    assert_close(expected, weights(two))
    # The adapter moved: a comparison of two untrained adapters would prove nothing.
    assert any(float(tensor.abs().max()) > 1e-3 for name, tensor in expected.items() if "lora_B" in name)


def test_two_ranks_train_a_dpo_adapter_as_one_process_does(inputs, tmp_path):
    """DPO's pairs split the same way (packed, a batch of 3 in micro-batches of one, gradient checkpointing)."""
    pairs = [encode(example, load_tokenizer(inputs.base_path), 128)
             for example in iter_valid_pairs(raw(preference_lines()))]
    hp = replace(HP, method=DPO, beta=0.5, n_epochs=1, packing=True, gradient_checkpointing=True)
    dpo = replace(inputs, hyperparameters=hp.to_dict(), train=pairs, valid=pairs[:2])
    one_hooks, two_hooks = Hooks(), Hooks()
    one = train(dpo, 1, tmp_path / "one", one_hooks)
    two = train(dpo, 2, tmp_path / "two", two_hooks)
    assert two.steps == one.steps == 3 and two_hooks.losses == pytest.approx(one_hooks.losses, rel=1e-4)
    assert_close(weights(one), weights(two))


def test_a_killed_two_rank_run_resumes_to_the_uninterrupted_adapter(inputs, two_ranks, tmp_path):
    interrupted = Hooks(fail_after=4)
    ranks: list = []
    with pytest.raises(RuntimeError, match="worker lost"):
        train(inputs, 2, tmp_path / "killed", interrupted, ranks=ranks)
    assert len(ranks) == 1 and ranks[0].poll() is not None
    assert sorted(interrupted.checkpoints) == [3]

    straight = weights(two_ranks[0])
    resumed = train(inputs, 2, tmp_path / "resumed", Hooks(), resume_from=interrupted.checkpoints[3])
    assert resumed.resumed_from_step == 3 and resumed.steps == 6
    got = weights(resumed)
    assert got.keys() == straight.keys() and all(torch.equal(straight[name], got[name]) for name in straight)

    alone = train(inputs, 1, tmp_path / "alone", Hooks(), resume_from=interrupted.checkpoints[3])
    assert_close(straight, weights(alone))


def test_a_pause_stops_every_rank_at_rank_0s_checkpoint_and_resumes_exactly(inputs, two_ranks, tmp_path):
    """A pause or the worker's stop (should_interrupt, asked of rank 0 only) checkpoints the steps done."""
    paused = Hooks()
    steps: list[int] = []
    paused.on_step = lambda step, *rest: steps.append(step)
    with pytest.raises(TrainingInterrupted) as interrupted:
        train(inputs, 2, tmp_path / "paused", paused, should_interrupt=lambda: len(steps) >= 2)
    assert interrupted.value.step == 2 and sorted(paused.checkpoints) == [2]

    resumed = train(inputs, 2, tmp_path / "resumed", Hooks(), resume_from=paused.checkpoints[2])
    straight, got = weights(two_ranks[0]), weights(resumed)
    assert resumed.resumed_from_step == 2 and all(torch.equal(straight[name], got[name]) for name in straight)


@pytest.mark.django_db
def test_a_job_on_two_gpus_runs_in_the_task_and_publishes(platform, tenant_a, settings):
    settings.TRAINING_CHECKPOINT_EVERY_STEPS = 2
    Tier.objects.filter(pk=tenant_a.tenant.tier_id).update(max_gpus_per_job=2)
    created = datasets.dataset_create(tenant=tenant_a.tenant, source=jsonl(chat_lines(1)), filename="t.jsonl")
    dataset = datasets.dataset_validate(dataset_id=created.pk)
    job = jobs.training_job_create(tenant=tenant_a.tenant, training_file=dataset.pk, adapter="support-bot", seed=1,
                                   hyperparameters={"n_epochs": 1, "batch_size": 2, "r": 4, "gpus": 2})
    concurrency.training_jobs_dispatch()
    run.training_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.SUCCEEDED, job.error_message
    assert job.hyperparameters["gpus"] == 2 and job.step == job.total_steps == 4
    assert job.version == "1.0.0" and job.adapter_version is not None
    assert job.events.filter(message="Checkpoint saved at step 2.").exists()


def rank_processes(storage_url: str) -> list[int]:
    """The pids of training ranks ≥ 1 started for this test's workers (found by their environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"training.ranks" in command and f"STORAGE_URL={storage_url}".encode() in environ:
            found.append(int(entry.name))
    return found


@pytest.mark.django_db(transaction=True)
def test_a_killed_workers_two_gpu_job_resumes_on_the_next_worker(platform, client_a, tenant_a, start_worker,
                                                                  settings):
    """SIGKILL to the worker (its process group): its rank 1, in a session of its own, dies with it
    (PR_SET_PDEATHSIG, or its next collective failing); the redelivered task resumes from the
    checkpoint on two ranks again."""
    env = {"CELERY_VISIBILITY_TIMEOUT": 3, "TRAINING_LEASE_SECONDS": 2, "TRAINING_CHECKPOINT_EVERY_STEPS": 4,
           "TRAINING_LOG_EVERY_STEPS": 1, "OMP_NUM_THREADS": 1}
    Tier.objects.filter(pk=tenant_a.tenant.tier_id).update(max_gpus_per_job=2)
    first = start_worker(**env)
    response = client_a.post("/api/v1/datasets", {"file": _upload()}, format="multipart")
    dataset_id = response.json()["id"]
    wait_for(lambda: Dataset.objects.get(pk=dataset_id).status == Dataset.Status.READY, 60, "validation")
    job_id = client_a.post("/api/v1/training-jobs", {
        "training_file": dataset_id, "adapter": "two-gpus", "seed": 3,
        # 16 examples in batches of 2: 8 steps an epoch, 16 in all; killed after its step-4 checkpoint, the
        # resumed job crosses an epoch.
        "hyperparameters": {"n_epochs": 2, "batch_size": 2, "learning_rate": 1e-2, "lora_dropout": 0.0, "gpus": 2},
    }, format="json").json()["id"]
    wait_for(lambda: Checkpoint.objects.filter(job_id=job_id).exists(), 180, "the first checkpoint", poll=0.05)
    assert len(rank_processes(settings.STORAGE_URL)) == 1
    first.kill()
    assert TrainingJob.objects.get(pk=job_id).status == TrainingJob.Status.RUNNING, "the job ended before the kill"
    wait_for(lambda: not rank_processes(settings.STORAGE_URL), 30, "the killed worker's rank 1 to die with it")

    start_worker(**env)
    job = wait_for(lambda: (lambda row: row if row.is_final else None)(TrainingJob.objects.get(pk=job_id)), 300,
                   "the job to finish", poll=0.5)
    assert job.status == TrainingJob.Status.SUCCEEDED and job.attempts == 2, job.error_message
    resumed = job.events.get(message__startswith="Resuming from the checkpoint of step")
    after = [event.data["step"] for event in job.events.filter(type=TrainingEvent.Type.METRICS, id__gt=resumed.id)
             .order_by("id")]
    assert after[0] == resumed.data["step"] + 1 and after[-1] == job.total_steps == 16
    assert job.adapter_version is not None and not rank_processes(settings.STORAGE_URL)


@pytest.mark.django_db
def test_the_tier_refuses_more_gpus_than_it_allows(platform, client_a, tenant_a):
    response = client_a.post("/api/v1/datasets", {"file": _upload()}, format="multipart")
    datasets.dataset_validate(dataset_id=response.json()["id"])
    body = {"training_file": response.json()["id"], "adapter": "support-bot"}

    refused = client_a.post("/api/v1/training-jobs", {**body, "hyperparameters": {"gpus": 2}}, format="json")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "max_gpus_per_job_exceeded" and error["param"] == "hyperparameters.gpus"
    assert "max_gpus_per_job" in error["message"] and "tier 'standard' allows at most 1" in error["message"]
    assert not TrainingJob.objects.exists()

    beyond = client_a.post("/api/v1/training-jobs", {**body, "hyperparameters": {"gpus": 9}}, format="json")
    assert beyond.status_code == 400 and beyond.json()["error"]["code"] == "hyperparameter_out_of_range"

    Tier.objects.filter(pk=tenant_a.tenant.tier_id).update(max_gpus_per_job=2)
    accepted = client_a.post("/api/v1/training-jobs", {**body, "hyperparameters": {"gpus": 2}}, format="json")
    assert accepted.status_code == 201, accepted.json()
    default = client_a.post("/api/v1/training-jobs", {**body, "adapter": "other-bot"}, format="json")
    assert default.status_code == 201
    assert [job.hyperparameters["gpus"] for job in TrainingJob.objects.order_by("pk")] == [2, 1]


def _upload():
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile("train.jsonl", jsonl(chat_lines()))
