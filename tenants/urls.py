from django.urls import path
from rest_framework.routers import SimpleRouter

from tenants.api import ApiKeyViewSet, TenantView

router = SimpleRouter(trailing_slash="/?")
router.register("api-keys", ApiKeyViewSet, basename="api-key")

urlpatterns = [path("tenant", TenantView.as_view(), name="tenant"), *router.urls]
