"""Admin for datasets and training jobs; the cancel and retry actions call training.jobs."""

from __future__ import annotations

from collections.abc import Callable

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from serving.contracts.errors import ServiceError
from training import datasets, jobs
from training.models import Checkpoint, Dataset, TrainingEvent, TrainingJob


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["id", "tenant", "filename", "format", "status", "num_examples", "size_bytes", "created_at"]
    list_filter = ["status", "format", "tenant"]
    search_fields = ["filename", "tenant__slug", "sha256"]
    readonly_fields = ["tenant", "filename", "storage_key", "sha256", "size_bytes", "format", "status",
                       "num_examples", "report", "created_at", "validated_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # datasets arrive through the API, streamed to storage with their sha256

    def delete_model(self, request: HttpRequest, obj: Dataset) -> None:
        datasets.dataset_delete(dataset=obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Dataset]) -> None:
        for dataset in queryset:
            try:
                datasets.dataset_delete(dataset=dataset)
            except ServiceError as error:
                self.message_user(request, error.message, messages.ERROR)


class TrainingEventInline(admin.TabularInline):
    model = TrainingEvent
    # A tuple, so that both attributes may hold it (the stubs type `fields` wider than `readonly_fields`).
    fields = ("created_at", "level", "type", "message")
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ["-id"]

    def has_add_permission(self, request: HttpRequest, obj: TrainingJob | None = None) -> bool:
        return False


class CheckpointInline(admin.TabularInline):
    model = Checkpoint
    fields = ("step", "storage_prefix", "metrics", "created_at")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: TrainingJob | None = None) -> bool:
        return False


@admin.register(TrainingJob)
class TrainingJobAdmin(admin.ModelAdmin):
    list_display = ["id", "tenant", "adapter_name", "version", "status", "step", "total_steps", "attempts",
                    "created_at", "finished_at"]
    list_filter = ["status", "tenant", "base_model"]
    search_fields = ["adapter_name", "tenant__slug"]
    readonly_fields = [field.name for field in TrainingJob._meta.fields]
    inlines = [CheckpointInline, TrainingEventInline]
    actions = ["cancel_jobs", "retry_jobs"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # jobs are created through the API, where every input is validated

    def _each(self, request: HttpRequest, queryset: QuerySet[TrainingJob], service: Callable[..., TrainingJob],
              done: str) -> None:
        count = 0
        for job in queryset:
            try:
                service(job=job)
                count += 1
            except ServiceError as error:
                self.message_user(request, f"Job {job.pk}: {error.message}", messages.ERROR)
        if count:
            self.message_user(request, f"{count} job(s) {done}.", messages.SUCCESS)

    @admin.action(description="Cancel the selected jobs", permissions=("change",))
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[TrainingJob]) -> None:
        self._each(request, queryset, jobs.training_job_cancel, "cancelled (running ones stop at their next step)")

    @admin.action(description="Retry the selected failed or cancelled jobs", permissions=("change",))
    def retry_jobs(self, request: HttpRequest, queryset: QuerySet[TrainingJob]) -> None:
        self._each(request, queryset, jobs.training_job_retry, "queued again")
