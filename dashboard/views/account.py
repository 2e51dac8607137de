"""Signing in and out, and which tenant the session acts for (the top bar's switcher)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError
from django.http import HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from dashboard.tenancy import DashboardRequest, Role, dashboard_view, tenant_switch
from tenants import login_throttle


class LoginForm(AuthenticationForm):
    """Django's login form, saying so when the sign-in throttle refused the attempt."""

    error_messages = {
        **AuthenticationForm.error_messages,
        "invalid_login": "Your username and password did not match. Try again.",
    }

    def clean(self) -> dict[str, object]:
        try:
            return super().clean()
        except ValidationError:
            refusal = login_throttle.refusal_of(self.request) if self.request is not None else None
            if refusal is not None:
                raise ValidationError(refusal.message, code="throttled") from None
            raise


class LoginView(auth_views.LoginView):
    template_name = "dashboard/login.html"
    authentication_form = LoginForm
    redirect_authenticated_user = True


@require_POST
@dashboard_view(Role.VIEWER)
def tenant_switch_view(request: DashboardRequest) -> HttpResponse:
    context = tenant_switch(request, slug=request.POST.get("tenant", ""))
    messages.info(request, f"Now acting for {context.tenant.name}.")
    return redirect("dashboard:overview")
