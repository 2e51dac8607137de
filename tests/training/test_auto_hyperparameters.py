"""OpenAI's "auto" for n_epochs, batch_size and learning_rate_multiplier, through the SDK in this
process: picked from the training examples when the job is created on a validated file, shown as
"auto" while its file is being validated and picked when it is (training.hyperparameters)."""

from __future__ import annotations

import pytest

from training import datasets, jobs
from training.models import TrainingJob
from training_support import BASE_MODEL_NAME, chat_lines, jsonl

pytestmark = pytest.mark.django_db

AUTO = {"n_epochs": "auto", "batch_size": "auto", "learning_rate_multiplier": "auto"}


def upload(client, *, validate: bool) -> str:
    created = client.files.create(file=("train.jsonl", jsonl(chat_lines(2))), purpose="fine-tune")
    if validate:
        datasets.dataset_validate(dataset_id=int(created.id.removeprefix("file-")))
    return created.id


def test_auto_is_picked_from_the_examples_of_a_validated_file(openai_a):
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=upload(openai_a, validate=True),
                                           hyperparameters=AUTO)
    # 16 examples: 100 // 16 = 6 epochs (at least 100 examples seen), batch 4, a small set's 10 × the rate.
    assert (job.hyperparameters.n_epochs, job.hyperparameters.batch_size) == (6, 4)
    assert job.hyperparameters.learning_rate_multiplier == 10
    row = TrainingJob.objects.get(pk=int(job.id.removeprefix("ftjob-")))
    assert row.total_steps == 6 * 4 and row.hyperparameters["auto"] == []


def test_auto_waits_for_the_file_then_is_picked(openai_a):
    file_id = upload(openai_a, validate=False)
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=file_id,
                                           hyperparameters={**AUTO, "batch_size": 2})
    assert job.status == "validating_files"
    assert (job.hyperparameters.n_epochs, job.hyperparameters.batch_size) == ("auto", 2)
    assert job.hyperparameters.learning_rate_multiplier == "auto"
    dataset_id = int(file_id.removeprefix("file-"))
    datasets.dataset_validate(dataset_id=dataset_id)
    jobs.training_jobs_release(dataset_id=dataset_id)
    settled = openai_a.fine_tuning.jobs.retrieve(job.id)
    assert (settled.hyperparameters.n_epochs, settled.hyperparameters.batch_size) == (6, 2)
    assert settled.hyperparameters.learning_rate_multiplier == pytest.approx(10 * (2 / 4) ** 0.5)
    assert TrainingJob.objects.get(pk=int(job.id.removeprefix("ftjob-"))).total_steps == 6 * 8
