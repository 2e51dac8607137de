"""A training job's kept checkpoints as models: deploying one as a version of the job's adapter.

(The job's page lists them, each with a link that opens the Playground on it; the Playground
lists every kept checkpoint among its models, serving.gateway.catalog.servable_models.) The view is
one training.checkpoint_versions call with the user as the audit actor, as the adapter pages are.
"""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from dashboard.tenancy import DashboardRequest, Role, dashboard_actor, dashboard_view
from training.checkpoint_versions import checkpoint_version_create
from serving.contracts.errors import ServiceError
from training import selectors
from serving.contracts.checkpoint_names import checkpoint_pinned_name


def checkpoint_models(checkpoints: list) -> list[dict[str, object]]:
    """Each checkpoint with the `model` that calls it (None for one saved before checkpoints had artifacts)."""
    return [{"checkpoint": item, "model": checkpoint_pinned_name(adapter=item.job.adapter_name, job_id=item.job_id,
                                                                 step=item.step) if item.artifact_uri else None}
            for item in checkpoints]


@require_POST
@dashboard_view(Role.MEMBER)
def checkpoint_version_view(request: DashboardRequest, job_id: int, step: int) -> HttpResponse:
    job = selectors.job_get(tenant=request.dashboard.tenant, job_id=job_id)
    checkpoint = selectors.job_checkpoints(job=job).filter(step=step).first()
    if checkpoint is None:
        messages.error(request, f"Job {job.pk} no longer keeps a checkpoint of step {step} (a newer one replaced it).")
        return redirect("dashboard:job", job.pk)
    try:
        version = checkpoint_version_create(checkpoint=checkpoint, actor=dashboard_actor(request),
                                            version=request.POST.get("version", "").strip() or None,
                                            reason=request.POST.get("reason", "").strip())
    except ServiceError as error:
        messages.error(request, error.message)
        return redirect("dashboard:job", job.pk)
    messages.success(request, f"Version {version.version} of {job.adapter_name} is made from the checkpoint of step "
                              f"{step}; deploy it here.")
    return redirect("dashboard:adapter", job.adapter_name)
