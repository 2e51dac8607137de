"""REST for the adapter registry (tenant-scoped) and the serving workers' snapshot (token-guarded).

Views only translate HTTP to serving.registry.services / serving.registry.selectors calls and back; every rule
(states, limits, validation of artifacts) lives there. Lists are in the one list shape of
api.pagination: adapters by name (cursor: a name), versions newest first by semantic
version (cursor: a version), audit events newest first (cursor: an event id).
"""

from __future__ import annotations

import hmac
from typing import Any

from django.conf import settings
from django.db.models import Prefetch
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    inline_serializer,
)
from rest_framework import exceptions, mixins, serializers, status
from rest_framework.authentication import BaseAuthentication
from rest_framework.decorators import action
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from serving.contracts.errors import InvalidInput, NotFound
from api.parsers import JSONParser
from api.pagination import list_body, list_schema, page_request, paging_parameters, take
from serving.registry import selectors, services, usage
from serving.registry.models import ADAPTER_NAME_PATTERN, Adapter, AdapterVersion, DeploymentEvent
from serving.registry.versions import VERSION_PATH_PATTERN, SemVer
from tenants.scoping import TenantScopedViewSet, request_auth, request_tenant

# request.auth of a serving worker that presented the registry token.
REGISTRY_WORKER = "registry-worker"
_REASON = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="",
                                help_text="Why; kept in the audit log.")


def request_actor(request: Request) -> str:
    """How the audit log names the caller: the API key's prefix, or the dashboard user's name."""
    auth = request_auth(request)
    if auth.api_key is None and getattr(request.user, "is_authenticated", False):
        return f"user:{request.user.get_username()}"
    return auth.actor


class VersionSerializer(serializers.ModelSerializer):
    model = serializers.SerializerMethodField(help_text="The `model` value that pins this version.")
    # DRF's metaclass pops declared fields off the class, so this never shadows Field.source as drf-stubs think.
    source = serializers.SerializerMethodField()  # type: ignore[assignment]

    class Meta:
        model = AdapterVersion
        fields = ["version", "model", "status", "traffic_weight", "base_model", "rank", "lora_alpha",
                  "target_modules", "kind", "size_bytes", "artifact_uri", "manifest_sha256", "source", "created_at"]
        read_only_fields = fields

    def get_model(self, version: AdapterVersion) -> str:
        return f"{version.adapter.name}@{version.version}"

    def get_source(self, version: AdapterVersion) -> dict[str, str | int | None]:
        # A version made from a job's checkpoint also names the checkpoint's step (training.checkpoint_versions).
        return {"kind": version.source, "id": version.source_id or None,
                **({"checkpoint_step": version.source_checkpoint_step}
                   if version.source_checkpoint_step is not None else {})}


class CanaryStateSerializer(serializers.Serializer):
    version = serializers.CharField()
    weight = serializers.FloatField()


class AdapterSerializer(serializers.ModelSerializer):
    active_version = serializers.SerializerMethodField()
    canary = serializers.SerializerMethodField()
    version_count = serializers.SerializerMethodField()

    class Meta:
        model = Adapter
        fields = ["name", "description", "created_at", "active_version", "canary", "version_count"]
        read_only_fields = fields

    def _served(self, adapter: Adapter, status_: str) -> AdapterVersion | None:
        return next((item for item in adapter.versions.all() if item.status == status_), None)

    def get_active_version(self, adapter: Adapter) -> str | None:
        active = self._served(adapter, AdapterVersion.Status.ACTIVE)
        return active.version if active else None

    @extend_schema_field(CanaryStateSerializer(allow_null=True))
    def get_canary(self, adapter: Adapter) -> dict | None:
        canary = self._served(adapter, AdapterVersion.Status.CANARY)
        return {"version": canary.version, "weight": canary.traffic_weight} if canary else None

    def get_version_count(self, adapter: Adapter) -> int:
        return len(adapter.versions.all())


class AdapterCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=63, help_text="Lowercase slug; what requests name as `model`.")
    description = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="")


class UploadFieldsSerializer(serializers.Serializer):
    version = serializers.CharField(max_length=64, required=False, allow_blank=True, default="",
                                    help_text="Semantic version; the next patch release when omitted.")
    reason = _REASON


class UploadSerializer(UploadFieldsSerializer):
    """The multipart form (for the schema; the files are read from request.FILES, whatever their field names)."""

    files = serializers.ListField(
        child=serializers.FileField(), required=False,
        help_text="adapter_config.json and adapter_model.safetensors, or one .zip/.tar.gz with them at its root.",
    )


class ReasonSerializer(serializers.Serializer):
    reason = _REASON


class CanaryStartSerializer(serializers.Serializer):
    version = serializers.CharField(max_length=64)
    weight = serializers.FloatField(min_value=0.0, max_value=1.0, help_text="Share of traffic, 0–1.")
    reason = _REASON


class CanaryWeightSerializer(serializers.Serializer):
    weight = serializers.FloatField(min_value=0.0, max_value=1.0, help_text="Share of traffic, 0–1.")
    reason = _REASON


class RollbackSerializer(serializers.Serializer):
    version = serializers.CharField(max_length=64, required=False, allow_blank=True, default="",
                                    help_text="An earlier version to return to; by default the one before.")
    reason = _REASON


class EventSerializer(serializers.ModelSerializer):
    type = serializers.CharField(source="kind")

    class Meta:
        model = DeploymentEvent
        fields = ["id", "type", "from_version", "to_version", "from_weight", "to_weight", "actor", "reason",
                  "created_at"]
        read_only_fields = fields


def _validated(serializer_class: type[serializers.Serializer], request: Request) -> dict:
    payload = serializer_class(data=request.data)
    payload.is_valid(raise_exception=True)
    return payload.validated_data


_VERSION_PATH = rf"versions/(?P<version>{VERSION_PATH_PATTERN})"


class AdapterViewSet(mixins.RetrieveModelMixin, TenantScopedViewSet):
    """Adapters of the caller's tenant, their versions, deployment, canary, rollback and audit log."""

    queryset = Adapter.objects.select_related("tenant").prefetch_related(
        Prefetch("versions", queryset=AdapterVersion.objects.select_related("adapter__tenant"))
    )
    serializer_class = AdapterSerializer
    lookup_field = "name"
    lookup_value_regex = ADAPTER_NAME_PATTERN
    parser_classes = [JSONParser, MultiPartParser, FormParser]

    def get_object(self) -> Adapter:
        """The caller's adapter named in the URL; another tenant's is as missing as a nonexistent one."""
        name = self.kwargs["name"]
        adapter = self.get_queryset().filter(name=name).first()
        if adapter is None:
            raise NotFound(f"No adapter named '{name}'.", code="adapter_not_found", param="name")
        self.check_object_permissions(self.request, adapter)
        return adapter

    def _adapter_response(self, adapter: Adapter, status_code: int = status.HTTP_200_OK) -> Response:
        fresh = self.get_queryset().get(pk=adapter.pk)
        return Response(AdapterSerializer(fresh).data, status=status_code)

    def _version(self, version: str) -> AdapterVersion:
        return selectors.adapter_version_get(adapter=self.get_object(), version=version)

    @extend_schema(parameters=paging_parameters("the name"), responses=list_schema(AdapterSerializer, "AdapterList"),
                   summary="List adapters by name")
    def list(self, request: Request) -> Response:
        page = page_request(request)
        adapters = self.get_queryset().order_by("name")
        if page.after is not None:
            adapters = adapters.filter(name__gt=page.after)
        rows, has_more = take(adapters, page.limit)
        serialized = AdapterSerializer(rows, many=True).data  # a ReturnList (drf-stubs call it a ReturnDict)
        return Response(list_body(serialized, has_more=has_more, id_key="name"))  # type: ignore[arg-type]

    @extend_schema(request=AdapterCreateSerializer, responses={201: AdapterSerializer}, summary="Create an adapter")
    def create(self, request: Request) -> Response:
        data = _validated(AdapterCreateSerializer, request)
        adapter = services.adapter_create(tenant=self.tenant, name=data["name"], description=data["description"])
        return self._adapter_response(adapter, status.HTTP_201_CREATED)

    @extend_schema(
        parameters=[OpenApiParameter("force", bool, description="Delete even while a version is served.")],
        responses={204: None}, summary="Delete an adapter, its versions and their artifacts",
    )
    def destroy(self, request: Request, name: str) -> Response:
        force = request.query_params.get("force", "").lower() in ("1", "true", "yes")
        services.adapter_delete(adapter=self.get_object(), actor=request_actor(request), force=force)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(methods=["GET"], parameters=paging_parameters("the version"),
                   operation_id="api_v1_adapters_versions_list",
                   responses=list_schema(VersionSerializer, "VersionList"),
                   summary="List an adapter's versions, newest semantic version first")
    @extend_schema(methods=["POST"], request={"multipart/form-data": UploadSerializer},
                   responses={201: VersionSerializer},
                   summary="Upload a PEFT adapter as a new version (multipart files or one .zip/.tar.gz)")
    @action(detail=True, methods=["get", "post"], url_path="versions")
    def versions(self, request: Request, name: str) -> Response:
        adapter = self.get_object()
        if request.method == "GET":
            page = page_request(request)
            versions = selectors.versions_by_precedence(adapter.versions.all())
            if page.after is not None:
                versions = [item for item in versions if SemVer(item.version) < _version_cursor(page.after)]
            rows, has_more = take(versions, page.limit)
            serialized = VersionSerializer(rows, many=True).data  # a ReturnList (drf-stubs call it a ReturnDict)
            return Response(list_body(serialized, has_more=has_more, id_key="version"))  # type: ignore[arg-type]
        if request.content_type.split(";")[0] != "multipart/form-data":
            raise InvalidInput("Upload the adapter as multipart/form-data: adapter_config.json and "
                               "adapter_model.safetensors, or one .zip/.tar.gz.", code="multipart_required")
        data = _validated(UploadFieldsSerializer, request)
        files = [item for key in request.FILES for item in request.FILES.getlist(key)]
        version = services.adapter_version_upload(
            adapter=adapter, files=files, actor=request_actor(request), version=data["version"] or None,
            reason=data["reason"],
        )
        return Response(VersionSerializer(version).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses=VersionSerializer, summary="Get one version")
    @action(detail=True, methods=["get"], url_path=_VERSION_PATH)
    def version_detail(self, request: Request, name: str, version: str) -> Response:
        return Response(VersionSerializer(self._version(version)).data)

    @extend_schema(request=ReasonSerializer, responses=AdapterSerializer,
                   summary="Make a version active (the old active version becomes deprecated)")
    @action(detail=True, methods=["post"], url_path=rf"{_VERSION_PATH}/deploy")
    def deploy(self, request: Request, name: str, version: str) -> Response:
        data = _validated(ReasonSerializer, request)
        deployed = services.adapter_version_deploy(version=self._version(version), actor=request_actor(request),
                                                   reason=data["reason"])
        return self._adapter_response(deployed.adapter)

    @extend_schema(request=ReasonSerializer, responses=VersionSerializer,
                   summary="Archive a version (never served again)")
    @action(detail=True, methods=["post"], url_path=rf"{_VERSION_PATH}/archive")
    def archive(self, request: Request, name: str, version: str) -> Response:
        data = _validated(ReasonSerializer, request)
        archived = services.adapter_version_archive(version=self._version(version), actor=request_actor(request),
                                                    reason=data["reason"])
        return Response(VersionSerializer(archived).data)

    @extend_schema(methods=["POST"], request=CanaryStartSerializer, responses=AdapterSerializer,
                   summary="Start a canary: serve a version beside the active one to a share of traffic")
    @extend_schema(methods=["PATCH"], request=CanaryWeightSerializer, responses=AdapterSerializer,
                   summary="Change the canary's share of traffic")
    @action(detail=True, methods=["post", "patch"], url_path="canary")
    def canary(self, request: Request, name: str) -> Response:
        adapter = self.get_object()
        actor = request_actor(request)
        if request.method == "POST":
            data = _validated(CanaryStartSerializer, request)
            version = selectors.adapter_version_get(adapter=adapter, version=data["version"])
            services.adapter_canary_start(version=version, weight=data["weight"], actor=actor, reason=data["reason"])
        else:
            data = _validated(CanaryWeightSerializer, request)
            services.adapter_canary_set_weight(adapter=adapter, weight=data["weight"], actor=actor,
                                               reason=data["reason"])
        return self._adapter_response(adapter)

    @extend_schema(request=ReasonSerializer, responses=AdapterSerializer,
                   summary="Promote the canary to active (the old active version becomes deprecated)")
    @action(detail=True, methods=["post"], url_path="canary/promote")
    def canary_promote(self, request: Request, name: str) -> Response:
        data = _validated(ReasonSerializer, request)
        adapter = self.get_object()
        services.adapter_canary_promote(adapter=adapter, actor=request_actor(request), reason=data["reason"])
        return self._adapter_response(adapter)

    @extend_schema(request=ReasonSerializer, responses=AdapterSerializer,
                   summary="Abort the canary: all traffic returns to the active version")
    @action(detail=True, methods=["post"], url_path="canary/abort")
    def canary_abort(self, request: Request, name: str) -> Response:
        data = _validated(ReasonSerializer, request)
        adapter = self.get_object()
        services.adapter_canary_abort(adapter=adapter, actor=request_actor(request), reason=data["reason"])
        return self._adapter_response(adapter)

    @extend_schema(request=RollbackSerializer, responses=AdapterSerializer,
                   summary="Roll back to the previously active version (or a named earlier one)")
    @action(detail=True, methods=["post"], url_path="rollback")
    def rollback(self, request: Request, name: str) -> Response:
        data = _validated(RollbackSerializer, request)
        adapter = self.get_object()
        services.adapter_rollback(adapter=adapter, actor=request_actor(request), version=data["version"] or None,
                                  reason=data["reason"])
        return self._adapter_response(adapter)

    @extend_schema(parameters=paging_parameters("the event id"),
                   responses=list_schema(EventSerializer, "DeploymentEventList", serializers.IntegerField),
                   summary="The adapter's audit log, newest first")
    @action(detail=True, methods=["get"], url_path="events")
    def events(self, request: Request, name: str) -> Response:
        page = page_request(request)
        events = selectors.adapter_events(adapter=self.get_object())
        after = page.int_after()
        if after is not None:
            events = events.filter(pk__lt=after)
        rows, has_more = take(events, page.limit)
        serialized = EventSerializer(rows, many=True).data  # a ReturnList (drf-stubs call it a ReturnDict)
        return Response(list_body(serialized, has_more=has_more))  # type: ignore[arg-type]


def _version_cursor(after: str) -> SemVer:
    try:
        return SemVer(after)
    except ValueError:
        raise InvalidInput(f"'after' must be a version like '1.2.0' (the last_id of the previous page), got "
                           f"{after!r}.", code="invalid_cursor", param="after") from None


class RegistryTokenAuthentication(BaseAuthentication):
    """Serving workers present `Authorization: Bearer <REGISTRY_TOKEN>` (compared in constant time)."""

    def authenticate(self, request: Request) -> tuple[None, str]:
        token = settings.REGISTRY_TOKEN
        if not token:
            raise exceptions.PermissionDenied("The registry snapshot is disabled: set REGISTRY_TOKEN on the web "
                                              "process and give serving workers the same token.")
        scheme, _, presented = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), token.encode()):
            raise exceptions.AuthenticationFailed(
                "A valid registry token is required: 'Authorization: Bearer <REGISTRY_TOKEN>'."
            )
        return None, REGISTRY_WORKER

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="loraplex-registry"'


class IsRegistryWorker(BasePermission):
    def has_permission(self, request: Request, view: APIView) -> bool:
        return request.auth == REGISTRY_WORKER


class RegistrySnapshotView(APIView):
    """What serving workers should keep resident; they poll it to heal missed deploy events."""

    authentication_classes = [RegistryTokenAuthentication]
    permission_classes = [IsRegistryWorker]

    @extend_schema(
        summary="Registry snapshot for serving workers (internal; registry token)",
        responses=OpenApiResponse(inline_serializer("RegistrySnapshot", {
            "revision": serializers.IntegerField(),
            "base_model": serializers.CharField(),
            "adapters": serializers.ListField(child=serializers.DictField()),
        })),
    )
    def get(self, request: Request) -> Response:
        return Response(selectors.registry_snapshot())


class UsageQuerySerializer(serializers.Serializer):
    start = serializers.DateTimeField(required=False, default=None,
                                      help_text="From this time (inclusive), ISO 8601; a date means its midnight UTC.")
    end = serializers.DateTimeField(required=False, default=None, help_text="Until this time (exclusive).")
    group_by = serializers.ChoiceField(choices=usage.GROUP_BY, required=False, default=None,
                                       help_text="Rows per `day`, `adapter` or API `key` besides the totals.")

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        data = {key: _midnight(value) if key in ("start", "end") else value for key, value in data.items()}
        values = super().to_internal_value(data)
        if values["start"] and values["end"] and values["start"] >= values["end"]:
            raise exceptions.ValidationError({"end": ["end must be after start."]})
        return values


def _midnight(value: str) -> str:
    return f"{value}T00:00:00Z" if isinstance(value, str) and len(value) == 10 else value


class UsageView(APIView):
    """The tenant's gateway usage: totals equal the sum of the `usage` of its responses."""

    @extend_schema(parameters=[UsageQuerySerializer], summary="Gateway usage of the tenant (totals, grouped rows)",
                   responses=OpenApiResponse(description="`{object, start, end, group_by, totals, data, complete}`"))
    def get(self, request: Request) -> Response:
        query = UsageQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        # What the gateway recorded so far is counted, not only what the last batch wrote; with Redis
        # away, the database's rows are answered and `complete` says that queued ones are missing.
        complete = usage.usage_records_flush_for_read()
        summary = usage.usage_summary(tenant=request_tenant(request), **query.validated_data)
        return Response({**summary, "complete": complete})
