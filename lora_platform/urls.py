"""URL map: admin, the management API (/api/v1/), the OpenAPI schema, and JSON error handlers."""

from django.contrib import admin
from django.http import HttpRequest, JsonResponse
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from lora_platform.api_errors import error_response

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(permission_classes=[], authentication_classes=[]),
         name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema", permission_classes=[],
                                                      authentication_classes=[]), name="api-docs"),
    path("api/v1/", include("tenants.urls")),
    path("api/v1/", include("serving.urls")),
    path("api/v1/", include("training.urls")),
]


def handler404(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return error_response(404, f"No route for {request.method} {request.path}.", code="not_found")


def handler500(request: HttpRequest) -> JsonResponse:
    return error_response(500, "Internal server error.", code="internal_error", error_type="api_error")
