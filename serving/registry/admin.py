"""Django admin for the registry: adapters with their versions, and the audit log.

Every change goes through serving.registry.services, after a confirmation page that says what will happen,
and is audited with the admin user (`admin:<username>`). Rows are read-only here: versions come
from uploads and training, states change only through the actions below, and each action needs the
model's change permission: view-only staff read the registry but never move it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import Model, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from serving.contracts.errors import ServiceError
from serving.registry import selectors, services
from serving.registry.models import Adapter, AdapterVersion, DeploymentEvent, UsageRecord

CONFIRM_TEMPLATE = "admin/serving/confirm_action.html"


class ActionForm(forms.Form):
    """What a confirmation page asks: a reason for the audit log, and a weight where one is needed."""

    weight = forms.FloatField(min_value=0.0, max_value=1.0, required=False,
                              help_text="The canary's share of the adapter's traffic, from 0 to 1 (0.1 = 10 %).")
    reason = forms.CharField(max_length=2000, required=False, widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
                             help_text="Kept in the audit log.")

    def __init__(self, *args: Any, needs_weight: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if needs_weight:
            self.fields["weight"].required = True
        else:
            del self.fields["weight"]


def admin_actor(request: HttpRequest) -> str:
    return f"admin:{request.user.get_username()}"


class _RegistryActions(admin.ModelAdmin):
    """Runs an admin action in two steps: a confirmation page (the service's dry run), then the service call
    per object."""

    def run_confirmed(
        self, request: HttpRequest, queryset: QuerySet, *, action: str, title: str,
        describe: Callable[[Any], str], perform: Callable[[Any, dict[str, Any]], object], needs_weight: bool = False,
    ) -> TemplateResponse | None:
        confirmed = request.POST.get("confirm") == "yes"
        form = ActionForm(request.POST if confirmed else None, needs_weight=needs_weight)
        if confirmed and form.is_valid():
            done = 0
            for obj in queryset:
                try:
                    perform(obj, form.cleaned_data)
                    done += 1
                except ServiceError as error:
                    self.message_user(request, f"{obj}: {error.message}", messages.ERROR)
            if done:
                self.message_user(request, f"{title}: done for {done} of {queryset.count()}.", messages.SUCCESS)
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": f"{title}?",
            "action": action,
            "items": [(obj, self._preview(describe, obj)) for obj in queryset],
            "form": form,
            "opts": self.model._meta,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, CONFIRM_TEMPLATE, context)

    @staticmethod
    def _preview(describe: Callable[[Any], str], obj: Any) -> str:
        """What the action will do to obj, or why the service refuses it: describe runs the service's
        dry run first, so a refusal here is the very error the confirmed action would raise."""
        try:
            return describe(obj)
        except ServiceError as error:
            return f"Refused: {error.message}"


class AdapterVersionInline(admin.TabularInline):
    model = AdapterVersion
    fields = ("version", "status", "traffic_weight", "base_model", "rank", "source", "manifest_sha256", "created_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True
    ordering = ("-created_at",)

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


@admin.register(Adapter)
class AdapterAdmin(_RegistryActions, admin.ModelAdmin):
    list_display = ("__str__", "active_version", "canary", "created_at")
    list_filter = ("tenant", "versions__status", "versions__base_model")
    search_fields = ("name", "tenant__slug", "description")
    inlines = (AdapterVersionInline,)
    actions = ("promote_canary", "set_canary_weight", "abort_canary", "rollback")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Adapter]:
        return super().get_queryset(request).select_related("tenant").distinct()

    def get_readonly_fields(self, request: HttpRequest, obj: Adapter | None = None) -> tuple[str, ...]:
        # Name and tenant fix the adapter's storage paths and the `model` clients send.
        return ("tenant", "name", "created_at") if obj is not None else ("created_at",)

    def save_model(self, request: HttpRequest, obj: Adapter, form: forms.ModelForm, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        created = services.adapter_create(tenant=obj.tenant, name=obj.name, description=obj.description)
        obj.pk, obj.created_at = created.pk, created.created_at

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        # Deleting also deletes artifacts and stops serving; it goes through the API (DELETE with force).
        return False

    @admin.display(description="active version")
    def active_version(self, adapter: Adapter) -> str:
        active, _ = selectors.adapter_served(adapter=adapter)
        return active.version if active else "—"

    @admin.display(description="canary")
    def canary(self, adapter: Adapter) -> str:
        _, canary = selectors.adapter_served(adapter=adapter)
        return f"{canary.version} ({canary.traffic_weight:.0%})" if canary else "—"

    @admin.action(description="Promote the canary of selected adapters to active", permissions=("change",))
    def promote_canary(self, request: HttpRequest, queryset: QuerySet[Adapter]) -> TemplateResponse | None:
        def describe(adapter: Adapter) -> str:
            canary = services.adapter_canary_promote(adapter=adapter, actor=admin_actor(request), dry_run=True)
            active, _ = selectors.adapter_served(adapter=adapter)
            old = f"; {active.version} becomes deprecated" if active else ""
            return f"Canary {canary.version} ({canary.traffic_weight:.0%}) becomes the active version{old}."

        return self.run_confirmed(
            request, queryset, action="promote_canary", title="Promote canary", describe=describe,
            perform=lambda adapter, data: services.adapter_canary_promote(
                adapter=adapter, actor=admin_actor(request), reason=data["reason"]),
        )

    @admin.action(description="Set the canary weight of selected adapters", permissions=("change",))
    def set_canary_weight(self, request: HttpRequest, queryset: QuerySet[Adapter]) -> TemplateResponse | None:
        def describe(adapter: Adapter) -> str:
            canary = services.adapter_canary_set_weight(adapter=adapter, weight=None, actor=admin_actor(request),
                                                        dry_run=True)
            return (f"Canary {canary.version} receives {canary.traffic_weight:.0%} of traffic now; it will receive "
                    "the weight below.")

        return self.run_confirmed(
            request, queryset, action="set_canary_weight", title="Set canary weight", describe=describe,
            needs_weight=True,
            perform=lambda adapter, data: services.adapter_canary_set_weight(
                adapter=adapter, weight=data["weight"], actor=admin_actor(request), reason=data["reason"]),
        )

    @admin.action(description="Abort the canary of selected adapters", permissions=("change",))
    def abort_canary(self, request: HttpRequest, queryset: QuerySet[Adapter]) -> TemplateResponse | None:
        def describe(adapter: Adapter) -> str:
            canary = services.adapter_canary_abort(adapter=adapter, actor=admin_actor(request), dry_run=True)
            active, _ = selectors.adapter_served(adapter=adapter)
            back = active.version if active else "the active version"
            return f"Canary {canary.version} stops and becomes deprecated; all traffic returns to {back}."

        return self.run_confirmed(
            request, queryset, action="abort_canary", title="Abort canary", describe=describe,
            perform=lambda adapter, data: services.adapter_canary_abort(
                adapter=adapter, actor=admin_actor(request), reason=data["reason"]),
        )

    @admin.action(description="Roll back selected adapters to their previous version", permissions=("change",))
    def rollback(self, request: HttpRequest, queryset: QuerySet[Adapter]) -> TemplateResponse | None:
        def describe(adapter: Adapter) -> str:
            target = services.adapter_rollback(adapter=adapter, actor=admin_actor(request), dry_run=True)
            active, _ = selectors.adapter_served(adapter=adapter)
            current = active.version if active else "the active version"
            return f"{current} becomes deprecated; {target.version} becomes active again."

        return self.run_confirmed(
            request, queryset, action="rollback", title="Roll back", describe=describe,
            perform=lambda adapter, data: services.adapter_rollback(
                adapter=adapter, actor=admin_actor(request), reason=data["reason"]),
        )


@admin.register(AdapterVersion)
class AdapterVersionAdmin(_RegistryActions, admin.ModelAdmin):
    list_display = ("__str__", "status", "traffic_weight", "base_model", "rank", "source", "created_at")
    list_filter = ("adapter__tenant", "status", "base_model", "source")
    search_fields = ("adapter__name", "adapter__tenant__slug", "version", "manifest_sha256")
    actions = ("deploy", "start_canary", "archive")

    def get_queryset(self, request: HttpRequest) -> QuerySet[AdapterVersion]:
        return super().get_queryset(request).select_related("adapter__tenant")

    def get_readonly_fields(self, request: HttpRequest, obj: AdapterVersion | None = None) -> list[str]:
        return [field.name for field in AdapterVersion._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    @admin.action(description="Deploy selected versions (make them active)", permissions=("change",))
    def deploy(self, request: HttpRequest, queryset: QuerySet[AdapterVersion]) -> TemplateResponse | None:
        def describe(version: AdapterVersion) -> str:
            services.adapter_version_deploy(version=version, actor=admin_actor(request), dry_run=True)
            active, _ = selectors.adapter_served(adapter=version.adapter)
            old = f"; {active.version} becomes deprecated" if active else ""
            return f"{version.version} ({version.status}) becomes the active version{old}."

        return self.run_confirmed(
            request, queryset, action="deploy", title="Deploy", describe=describe,
            perform=lambda version, data: services.adapter_version_deploy(
                version=version, actor=admin_actor(request), reason=data["reason"]),
        )

    @admin.action(description="Start a canary with selected versions", permissions=("change",))
    def start_canary(self, request: HttpRequest, queryset: QuerySet[AdapterVersion]) -> TemplateResponse | None:
        def describe(version: AdapterVersion) -> str:
            services.adapter_canary_start(version=version, weight=None, actor=admin_actor(request), dry_run=True)
            active, _ = selectors.adapter_served(adapter=version.adapter)
            beside = active.version if active else "the active version"
            return f"{version.version} ({version.status}) is served beside {beside} at the weight below."

        return self.run_confirmed(
            request, queryset, action="start_canary", title="Start canary", describe=describe, needs_weight=True,
            perform=lambda version, data: services.adapter_canary_start(
                version=version, weight=data["weight"], actor=admin_actor(request), reason=data["reason"]),
        )

    @admin.action(description="Archive selected versions (never served again)", permissions=("change",))
    def archive(self, request: HttpRequest, queryset: QuerySet[AdapterVersion]) -> TemplateResponse | None:
        def describe(version: AdapterVersion) -> str:
            services.adapter_version_archive(version=version, actor=admin_actor(request), dry_run=True)
            return f"{version.version} ({version.status}) is archived for good."

        return self.run_confirmed(
            request, queryset, action="archive", title="Archive", describe=describe,
            perform=lambda version, data: services.adapter_version_archive(
                version=version, actor=admin_actor(request), reason=data["reason"]),
        )


@admin.register(DeploymentEvent)
class DeploymentEventAdmin(admin.ModelAdmin):
    list_display = ("created_at", "tenant", "adapter_name", "kind", "from_version", "to_version", "from_weight",
                    "to_weight", "actor", "reason")
    list_filter = ("tenant", "kind")
    search_fields = ("adapter_name", "actor", "from_version", "to_version", "reason")
    date_hierarchy = "created_at"

    def get_readonly_fields(self, request: HttpRequest, obj: DeploymentEvent | None = None) -> list[str]:
        return [field.name for field in DeploymentEvent._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    """Gateway usage, one row per request; written by the gateway only, so read-only here."""

    list_display = ("created_at", "tenant", "api_key_prefix", "model", "version", "prompt_tokens",
                    "completion_tokens", "status", "http_status", "degraded", "latency_ms", "worker")
    list_filter = ("status", "degraded", "endpoint", "tenant")
    search_fields = ("request_id", "model", "adapter", "api_key_prefix", "tenant__slug")
    date_hierarchy = "created_at"
    list_select_related = ("tenant",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False
