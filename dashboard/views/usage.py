"""Usage: the gateway's usage records by day, adapter and API key over a period, as tables, a chart and CSV."""

from __future__ import annotations

import csv
from datetime import datetime, timedelta

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from dashboard.tenancy import DashboardRequest, Role, dashboard_view
from serving.registry.usage import GROUP_BY, usage_summary
from tenants import selectors as tenant_selectors

USAGE_PERIODS = (1, 7, 30, 90)


def _usage_period(request: HttpRequest) -> tuple[int, datetime]:
    try:
        days = int(request.GET.get("days", 7))
    except ValueError:
        days = 7
    days = days if days in USAGE_PERIODS else 7
    today = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
    return days, today - timedelta(days=days - 1)


@dashboard_view(Role.VIEWER)
def usage_view(request: DashboardRequest) -> HttpResponse:
    tenant = request.dashboard.tenant
    days, start = _usage_period(request)
    by = {group: usage_summary(tenant=tenant, start=start, end=None, group_by=group) for group in GROUP_BY}
    key_names = dict(tenant_selectors.api_key_list(tenant=tenant).values_list("prefix", "name"))
    for row in by["key"]["data"]:
        row["name"] = key_names.get(row["api_key"], "")
    # The chart shows every day of the period, those without requests as zeros.
    counted = {row["day"]: row for row in by["day"]["data"]}
    chart = [counted.get(day, {"day": day, "requests": 0, "total_tokens": 0})
             for day in ((start + timedelta(days=n)).date().isoformat() for n in range(days))]
    return render(request, "dashboard/usage.html", {
        "days": days, "periods": USAGE_PERIODS, "totals": by["day"]["totals"], "by_day": by["day"]["data"],
        "chart": chart,
        "by_adapter": by["adapter"]["data"], "by_key": by["key"]["data"], "nav": "usage",
    })


@dashboard_view(Role.VIEWER)
def usage_csv_view(request: DashboardRequest) -> HttpResponse:
    """The usage table grouped by `group` (day, adapter or key) over the chosen period, as CSV."""
    group = request.GET.get("group", "day")
    if group not in GROUP_BY:
        group = "day"
    days, start = _usage_period(request)
    rows = usage_summary(tenant=request.dashboard.tenant, start=start, end=None, group_by=group)["data"]
    column = {"day": "day", "adapter": "adapter", "key": "api_key"}[group]
    response = HttpResponse(content_type="text/csv")
    response["Content-Disposition"] = (f'attachment; filename="usage-{request.dashboard.tenant.slug}-by-{group}-'
                                       f'{days}d.csv"')
    writer = csv.writer(response)
    writer.writerow([column, "requests", "prompt_tokens", "completion_tokens", "total_tokens"])
    for row in rows:
        writer.writerow([row[column] or "", row["requests"], row["prompt_tokens"], row["completion_tokens"],
                         row["total_tokens"]])
    return response
