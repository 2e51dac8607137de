from django.apps import AppConfig


class TrainingConfig(AppConfig):
    name = "training"
    verbose_name = "Datasets and training jobs"

    def ready(self) -> None:
        # The registry counts the names active jobs hold for their new adapters against the tier's
        # limit (docs/training.md, "Adapter names"); it imports nothing of training to do so.
        from serving.registry import adapter_names, job_models
        from training import selectors
        from training.job_models import TrainingJobModels

        adapter_names.adapter_name_holds_register(selectors.adapter_names_held)
        # The gateway resolves a job's model names (its version, its kept checkpoints) through the
        # registry's hook: serving never imports training (serving.registry.job_models).
        job_models.job_models_register(TrainingJobModels())
