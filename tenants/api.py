"""REST: the caller's tenant and tier, and the tenant's API keys (listed newest first, in the one list
shape of api.pagination)."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from api.pagination import list_body, list_schema, page_request, paging_parameters, take
from tenants import services
from tenants.models import ApiKey, Tenant, Tier
from tenants.permissions import CanManageApiKeys
from tenants.scoping import TenantScopedViewSet, request_tenant


class TierSerializer(serializers.ModelSerializer):
    class Meta:
        model = Tier
        fields = [
            "name", "requests_per_minute", "tokens_per_minute", "max_tokens_per_request", "priority",
            "max_concurrent_training_jobs", "max_adapters", "degradation_allowed",
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
        fields = ["id", "name", "prefix", "scopes", "created_by", "created_at", "last_used_at", "revoked_at"]
        read_only_fields = fields


class ApiKeyCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=ApiKey.Scope.values), required=False, allow_empty=False
    )


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
        key, full_key = services.api_key_create(
            tenant=self.tenant, name=payload.validated_data["name"], scopes=payload.validated_data.get("scopes"),
            created_by=self.tenant_auth.key_creator,
        )
        data = ApiKeySerializer(key).data | {"key": full_key}
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(responses=ApiKeySerializer, summary="Revoke an API key")
    def destroy(self, request: Request, *args: object, **kwargs: object) -> Response:
        key = services.api_key_revoke(api_key=self.get_object())
        return Response(ApiKeySerializer(key).data)
