"""URL map: admin, the management API (/api/v1/) and the OpenAPI schema.

Errors under /api/ and /v1/ are JSON whatever raised them: see lora_platform.middleware.ApiJsonErrorsMiddleware.
"""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

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
