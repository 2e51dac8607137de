from django.urls import path
from rest_framework.routers import SimpleRouter

from tenants.api import ApiKeyViewSet, TenantView

router = SimpleRouter()
# The documented paths have no trailing slash (/api/v1/api-keys); accept one too. The constructor
# turns any truthy trailing_slash into "/", so the optional slash is set afterwards.
router.trailing_slash = "/?"
router.register("api-keys", ApiKeyViewSet, basename="api-key")

urlpatterns = [path("tenant", TenantView.as_view(), name="tenant"), *router.urls]
