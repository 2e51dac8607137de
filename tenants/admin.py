"""Django admin for tiers, tenants, memberships and API keys.

API keys are read-only here: a key's secret exists only in the response that created it, so the
admin can list and revoke keys but never shows or edits their hashes; their limits are changed on
the dashboard, the REST API or `manage.py tenants update-key` (validated and audited there). The
access audit log (TenantEvent) is read-only. Tenants created here get
their first API key through the same service as the management command, shown once in a message.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from tenants import services
from tenants.models import ApiKey, Membership, Tenant, TenantEvent, Tier

API_KEY_FIELDS = ("tenant", "name", "key_hint", "scopes", "created_at", "last_used_at", "revoked_at", "expires_at",
                  "allowed_models", "requests_per_minute", "tokens_per_minute", "monthly_token_budget")


@admin.register(Tier)
class TierAdmin(admin.ModelAdmin):
    list_display = ("name", "priority", "requests_per_minute", "tokens_per_minute", "max_tokens_per_request",
                    "max_concurrent_training_jobs", "max_gpus_per_job", "max_adapters", "degradation_allowed")
    ordering = ("priority", "name")


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    raw_id_fields = ("user",)


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    fields = ("name", "key_hint", "scopes", "created_at", "last_used_at", "revoked_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True

    @admin.display(description="key")
    def key_hint(self, key: ApiKey) -> str:
        return f"lp-{key.prefix}.…"

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "tier", "status", "created_at")
    list_filter = ("status", "tier")
    search_fields = ("slug", "name")
    inlines = (MembershipInline, ApiKeyInline)
    actions = ("suspend_tenants", "activate_tenants")

    def get_readonly_fields(self, request: HttpRequest, obj: Tenant | None = None) -> tuple[str, ...]:
        # The slug names the tenant's storage paths and adapters; it is fixed once created.
        return ("slug", "created_at") if obj is not None else ("created_at",)

    def save_model(self, request: HttpRequest, obj: Tenant, form: object, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        tenant, key = services.tenant_create(slug=obj.slug, tier_name=obj.tier.name, name=obj.name)
        if obj.status != Tenant.Status.ACTIVE:
            services.tenant_set_status(slug=tenant.slug, status=obj.status)
        obj.pk, obj.created_at = tenant.pk, tenant.created_at
        self.message_user(request, f"Tenant '{tenant.slug}' created. Its first API key, shown once: {key}",
                          messages.WARNING)

    @admin.action(description="Suspend selected tenants (their keys and sessions get 403)", permissions=("change",))
    def suspend_tenants(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        for tenant in queryset:
            services.tenant_suspend(slug=tenant.slug)
        self.message_user(request, f"Suspended {queryset.count()} tenant(s).")

    @admin.action(description="Activate selected tenants", permissions=("change",))
    def activate_tenants(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        for tenant in queryset:
            services.tenant_activate(slug=tenant.slug)
        self.message_user(request, f"Activated {queryset.count()} tenant(s).")


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ("user", "tenant", "role", "created_at")
    list_filter = ("role", "tenant")
    search_fields = ("user__username", "user__email", "tenant__slug")
    raw_id_fields = ("user",)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("key_hint", "name", "tenant", "scopes", "created_at", "last_used_at", "revoked_at")
    list_filter = ("tenant", ("revoked_at", admin.EmptyFieldListFilter))
    search_fields = ("prefix", "name", "tenant__slug")
    fields = API_KEY_FIELDS
    readonly_fields = API_KEY_FIELDS
    actions = ("revoke_keys",)

    @admin.display(description="key")
    def key_hint(self, key: ApiKey) -> str:
        return f"lp-{key.prefix}.…"

    def has_add_permission(self, request: HttpRequest) -> bool:
        # A key's secret must be shown once to its tenant: keys come from the API or `manage.py tenants`.
        return False

    def has_change_permission(self, request: HttpRequest, obj: ApiKey | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: ApiKey | None = None) -> bool:
        return False

    @admin.action(description="Revoke selected API keys (they get 401 from now on)", permissions=("revoke",))
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        revoked = 0
        for key in queryset:
            revoked += key.revoked_at is None
            services.api_key_revoke(api_key=key, actor=f"admin:{request.user.get_username()}")
        self.message_user(request, f"Revoked {revoked} API key(s).")

    def has_revoke_permission(self, request: HttpRequest) -> bool:
        # Revoking is the one change an admin makes to a key; it needs the model's change permission.
        return request.user.has_perm("tenants.change_apikey")


@admin.register(TenantEvent)
class TenantEventAdmin(admin.ModelAdmin):
    list_display = ("created_at", "tenant", "kind", "subject", "actor", "reason")
    list_filter = ("kind", "tenant")
    search_fields = ("subject", "actor", "reason", "tenant__slug")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: TenantEvent | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: TenantEvent | None = None) -> bool:
        return False
