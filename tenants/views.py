"""Dashboard pages of the tenants app: log in and out, the tenant switcher, API keys."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from lora_platform.errors import ServiceError
from tenants import selectors, services
from tenants.dashboard import Role, dashboard_view, tenant_switch
from tenants.models import ApiKey


class LoginView(auth_views.LoginView):
    template_name = "dashboard/login.html"
    redirect_authenticated_user = True


@require_POST
@dashboard_view(Role.VIEWER)
def tenant_switch_view(request: HttpRequest) -> HttpResponse:
    context = tenant_switch(request, slug=request.POST.get("tenant", ""))
    messages.info(request, f"Now acting for {context.tenant.name}.")
    return redirect("dashboard:overview")


def _keys_page(request: HttpRequest, *, created: tuple[ApiKey, str] | None = None,
               error: ServiceError | None = None, status: int = 200) -> HttpResponse:
    tenant = request.dashboard.tenant
    return render(request, "dashboard/keys.html", {
        "keys": selectors.api_key_list(tenant=tenant), "scopes": ApiKey.Scope.choices,
        "created": created[0] if created else None, "created_secret": created[1] if created else None,
        "error": error, "nav": "keys",
    }, status=status)


@dashboard_view(Role.VIEWER)
def api_key_list_view(request: HttpRequest) -> HttpResponse:
    return _keys_page(request)


@require_POST
@dashboard_view(Role.OWNER)
def api_key_create_view(request: HttpRequest) -> HttpResponse:
    """Answers with the page itself, not a redirect: the full key is in this response and nowhere else."""
    try:
        created = services.api_key_create(tenant=request.dashboard.tenant, name=request.POST.get("name", ""),
                                          scopes=request.POST.getlist("scopes"))
    except ServiceError as error:
        return _keys_page(request, error=error, status=400)
    return _keys_page(request, created=created)


@require_POST
@dashboard_view(Role.OWNER)
def api_key_revoke_view(request: HttpRequest, key_id: int) -> HttpResponse:
    key = selectors.api_key_list(tenant=request.dashboard.tenant).filter(pk=key_id).first()
    if key is None:
        raise Http404(f"No API key {key_id}.")
    services.api_key_revoke(api_key=key)
    messages.success(request, f"Key lp-{key.prefix}… ({key.name}) is revoked; requests with it are refused.")
    return redirect("dashboard:keys")
