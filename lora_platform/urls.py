"""URL map: admin, the management API (/api/v1/), the OpenAPI schema and its docs pages, the gateway (/v1/,
/metrics), the probes (/healthz, /readyz: lora_platform.health), /favicon.ico and the tenant dashboard (/).

Errors under /api/ and /v1/ are JSON whatever raised them: see lora_platform.middleware.ApiJsonErrorsMiddleware.
"""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from lora_platform import health
from lora_platform.favicon import favicon
from serving.gateway import views as gateway

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(permission_classes=[], authentication_classes=[]),
         name="schema"),
    # Swagger UI and Redoc come from drf-spectacular-sidecar's static files (settings.SPECTACULAR_SETTINGS).
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema", permission_classes=[],
                                                      authentication_classes=[]), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="schema", permission_classes=[], authentication_classes=[],
                                                     template_name="api_docs/redoc.html"), name="api-redoc"),
    path("favicon.ico", favicon, name="favicon"),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("api/v1/", include("tenants.urls")),
    path("api/v1/", include("serving.registry.urls")),
    path("api/v1/", include("training.urls")),
    # The completion routes' one entry point is the ASGI fast path (serving.gateway.asgi); Django's own
    # handler (WSGI, its test client) says so.
    path("v1/chat/completions", gateway.completions_elsewhere, name="gateway-chat-completions"),
    path("v1/completions", gateway.completions_elsewhere, name="gateway-completions"),
    path("v1/models", gateway.models, name="gateway-models"),
    path("v1/models/<path:model>", gateway.model_detail, name="gateway-model"),
    path("metrics", gateway.metrics_view, name="gateway-metrics"),
    # OpenAI's files and fine-tuning API (/v1/files, /v1/fine_tuning/…).
    path("v1/", include("training.openai_urls")),
    # Last: the dashboard owns every path the others leave.
    path("", include("dashboard.urls")),
]
