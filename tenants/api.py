"""REST: the caller's tenant and tier, and the tenant's API keys (listed newest first, in the one list
shape of api.pagination), with their own controls (docs/keys.md): set at creation, changed by PATCH."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from api.pagination import list_body, list_schema, page_request, paging_parameters, take
from tenants import services
from tenants.key_controls import CONTROL_FIELDS
from tenants.models import ApiKey, Tenant, Tier
from tenants.permissions import CanManageApiKeys
from tenants.scoping import TenantScopedViewSet, request_tenant


class TierSerializer(serializers.ModelSerializer):
    class Meta:
        model = Tier
        fields = [
            "name", "requests_per_minute", "tokens_per_minute", "max_tokens_per_request", "priority",
            "max_concurrent_training_jobs", "max_gpus_per_job", "max_adapters", "degradation_allowed",
        ]


class TenantSerializer(serializers.ModelSerializer):
    tier = TierSerializer()

    class Meta:
        model = Tenant
        fields = ["slug", "name", "status", "tier", "created_at"]


class ApiKeySerializer(serializers.ModelSerializer):
    created_by: serializers.SlugRelatedField = serializers.SlugRelatedField(
        slug_field=get_user_model().USERNAME_FIELD, read_only=True, allow_null=True,
        help_text="The member who created it (revoked when they leave the tenant); null for the operator's keys.")

    class Meta:
        model = ApiKey
        fields = ["id", "name", "prefix", "scopes", "created_by", "created_at", "last_used_at", "revoked_at",
                  *CONTROL_FIELDS]
        read_only_fields = fields


class ApiKeyControlsSerializer(serializers.Serializer):
    """A key's own controls (docs/keys.md); each is optional, and null (or [] for the list) clears it.
    The values' rules are tenants.key_controls'; this only reads the JSON."""

    expires_at = serializers.DateTimeField(
        required=False, allow_null=True,
        help_text="From this time on the key is refused (401 key_expired). Must be in the future.")
    allowed_models = serializers.ListField(
        child=serializers.CharField(allow_blank=True, trim_whitespace=False), required=False, allow_null=True,
        help_text="The only models the key may call: adapter names (every version of them), 'adapter@version' "
                  "pins, the base model's name. Empty: every model of the tenant. Others get 403 model_not_allowed.")
    requests_per_minute = serializers.IntegerField(
        required=False, allow_null=True, help_text="The key's own rpm, at most the tier's (429 rate_limit_exceeded).")
    tokens_per_minute = serializers.IntegerField(
        required=False, allow_null=True, help_text="The key's own tpm, at most the tier's (429 rate_limit_exceeded).")
    monthly_token_budget = serializers.IntegerField(
        required=False, allow_null=True,
        help_text="Tokens the key may use per calendar month (UTC); past it, 429 key_budget_exceeded.")


class ApiKeyCreateSerializer(ApiKeyControlsSerializer):
    name = serializers.CharField(max_length=100)
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=ApiKey.Scope.values), required=False, allow_empty=False
    )
    reason = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="",
                                   help_text="Why; kept in the tenant's audit log.")


class ApiKeyUpdateSerializer(ApiKeyControlsSerializer):
    reason = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="",
                                   help_text="Why; kept in the tenant's audit log.")


def _controls(validated: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in validated.items() if name in CONTROL_FIELDS}


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(help_text="The full key. Shown once; store it now.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]
        read_only_fields = fields


class TenantView(APIView):
    @extend_schema(responses=TenantSerializer, summary="The caller's tenant and its tier's limits")
    def get(self, request: Request) -> Response:
        return Response(TenantSerializer(request_tenant(request)).data)


class ApiKeyViewSet(mixins.RetrieveModelMixin, mixins.DestroyModelMixin, TenantScopedViewSet):
    queryset = ApiKey.objects.select_related("created_by")
    serializer_class = ApiKeySerializer
    # Owners only for create and revoke, as on the dashboard (tenants.permissions).
    permission_classes = [CanManageApiKeys]

    @extend_schema(parameters=paging_parameters("the id"),
                   responses=list_schema(ApiKeySerializer, "ApiKeyList", serializers.IntegerField),
                   summary="List the tenant's API keys, newest first")
    def list(self, request: Request) -> Response:
        page = page_request(request)
        keys = self.get_queryset()
        after = page.int_after()
        if after is not None:
            keys = keys.filter(pk__lt=after)
        rows, has_more = take(keys.order_by("-id"), page.limit)
        serialized = ApiKeySerializer(rows, many=True).data  # a ReturnList (drf-stubs call it a ReturnDict)
        return Response(list_body(serialized, has_more=has_more))  # type: ignore[arg-type]

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: ApiKeyCreatedSerializer},
                   summary="Create an API key (the full key is returned once)")
    def create(self, request: Request) -> Response:
        payload = ApiKeyCreateSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        key, full_key = services.api_key_create(
            tenant=self.tenant, name=data["name"], scopes=data.get("scopes"), created_by=self.tenant_auth.key_creator,
            controls=_controls(data), actor=self.tenant_auth.actor, reason=data["reason"],
        )
        body = ApiKeySerializer(key).data | {"key": full_key}
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=ApiKeyUpdateSerializer, responses=ApiKeySerializer,
                   summary="Change an API key's expiry, allowed models, rate limits or monthly budget")
    def partial_update(self, request: Request, *args: object, **kwargs: object) -> Response:
        payload = ApiKeyUpdateSerializer(data=request.data, partial=True)
        payload.is_valid(raise_exception=True)
        key = services.api_key_update(api_key=self.get_object(), controls=_controls(payload.validated_data),
                                      actor=self.tenant_auth.actor, reason=payload.validated_data.get("reason", ""))
        return Response(ApiKeySerializer(key).data)

    @extend_schema(parameters=[OpenApiParameter("reason", str, required=False,
                                                description="Why; kept in the tenant's audit log.")],
                   responses={204: None}, summary="Revoke an API key (it stays listed, with its revoked_at)")
    def destroy(self, request: Request, *args: object, **kwargs: object) -> Response:
        # 204 and no body, as the schema has always said of a DELETE (it answered 200 with the key).
        services.api_key_revoke(api_key=self.get_object(), actor=self.tenant_auth.actor,
                                reason=request.query_params.get("reason", "")[:2000])
        return Response(status=status.HTTP_204_NO_CONTENT)
