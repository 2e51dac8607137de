"""The dataset pages: upload (streamed, stopped at the tier's limit), the validation report, preview, delete.

Views translate forms to training.datasets calls and back, as the REST API does; every rule (limits,
validation) lives in that service.
"""

from __future__ import annotations

from typing import Any, BinaryIO, cast

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt, csrf_protect
from django.views.decorators.http import require_POST

from dashboard.htmx import htmx_redirect, is_htmx
from dashboard.tenancy import DashboardRequest, Role, dashboard_view
from serving.contracts.errors import InvalidInput, ServiceError
from training import datasets, selectors
from training.api import DatasetUploadHandler
from training.models import Dataset


@dashboard_view(Role.VIEWER)
def dataset_list_view(request: DashboardRequest) -> HttpResponse:
    listed = selectors.dataset_list(tenant=request.dashboard.tenant)
    return render(request, "dashboard/datasets/list.html", {"datasets": listed, "nav": "datasets"})


@csrf_exempt
def dataset_upload_view(request: HttpRequest) -> HttpResponseBase:
    """The upload streams to disk through the API's handler, which stops at the tier's size limit.

    Upload handlers must be set before anything reads the body, and the CSRF check reads it, so the
    check runs inside (Django's documented csrf_exempt + csrf_protect pattern), within the `try`
    that answers a refused upload: the check is what parses the form, so a file over the limit is
    refused there.
    """
    request.upload_handlers = [DatasetUploadHandler(request)]
    return _dataset_upload(request)


@require_POST
@dashboard_view(Role.MEMBER)
def _dataset_upload(request: DashboardRequest) -> HttpResponse:
    # The handler reads the tenant (for its limit) from request.auth, as on the API.
    request.auth = request.dashboard.auth  # type: ignore[attr-defined]  # the attribute DRF's Request sets
    try:
        return _dataset_store(request)
    except ServiceError as error:
        messages.error(request, error.message)
        return htmx_redirect(request, reverse("dashboard:datasets"))


@csrf_protect
def _dataset_store(request: DashboardRequest) -> HttpResponse:
    upload = request.FILES.get("file")
    if upload is None:
        raise InvalidInput("Choose a JSONL file to upload.", code="missing_file", param="file")
    # An UploadedFile is a binary file object (the stubs type it as a File of any string type).
    dataset = datasets.dataset_create(tenant=request.dashboard.tenant, source=cast(BinaryIO, upload),
                                      filename=upload.name or "", size=upload.size)
    # Shown while the dataset validates (app.js drops it once the page shows another state).
    messages.success(request, f"Uploaded {dataset.filename}; validating it now.",
                     extra_tags=f"dataset-{dataset.pk}:uploaded,validating")
    return htmx_redirect(request, reverse("dashboard:dataset", args=[dataset.pk]))


@dashboard_view(Role.VIEWER)
def dataset_detail_view(request: DashboardRequest, dataset_id: int) -> HttpResponse:
    """The dataset's page; to htmx's poll (every 2 s while it validates) its report, and once
    validation has ended its actions too ("Train on it")."""
    dataset = selectors.dataset_get(tenant=request.dashboard.tenant, dataset_id=dataset_id)
    template = "dashboard/datasets/_report.html" if is_htmx(request) else "dashboard/datasets/detail.html"
    context = _dataset_context(dataset)
    # The poll that finds validation over is the last one (the report it gets polls no more): it
    # brings the page's actions too.
    return render(request, template, context | {"validated_now": is_htmx(request) and not context["pending"],
                                                "nav": "datasets"})


def _dataset_context(dataset: Dataset) -> dict[str, Any]:
    report = dataset.report or {}
    stats = report.get("stats") or {}
    histogram = stats.get("token_histogram") or []
    peak = max((bucket["count"] for bucket in histogram), default=0)
    return {
        "dataset": dataset, "report": report, "stats": stats,
        "histogram": [bucket | {"percent": round(100 * bucket["count"] / peak) if peak else 0}
                      for bucket in histogram],
        "preview": selectors.dataset_preview(dataset=dataset),
        "pending": dataset.status in (Dataset.Status.UPLOADED, Dataset.Status.VALIDATING),
    }


@require_POST
@dashboard_view(Role.MEMBER)
def dataset_delete_view(request: DashboardRequest, dataset_id: int) -> HttpResponse:
    dataset = selectors.dataset_get(tenant=request.dashboard.tenant, dataset_id=dataset_id)
    try:
        datasets.dataset_delete(dataset=dataset)
    except ServiceError as error:
        messages.error(request, error.message)
        return redirect("dashboard:dataset", dataset_id)
    messages.success(request, f"Deleted {dataset.filename}.")
    return redirect("dashboard:datasets")
