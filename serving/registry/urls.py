"""Routes of the adapter registry under /api/v1/ (see serving.registry.api)."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from serving.registry.api import AdapterViewSet, RegistrySnapshotView, UsageView

router = SimpleRouter()
# SimpleRouter only knows "/" or "" (a "/?" argument becomes "/"); the attribute takes the regex, so
# `/adapters/x/canary` and `/adapters/x/canary/` both route.
router.trailing_slash = "/?"
router.register("adapters", AdapterViewSet, basename="adapter")

urlpatterns = [
    path("internal/registry/snapshot", RegistrySnapshotView.as_view(), name="registry-snapshot"),
    path("usage", UsageView.as_view(), name="usage"),
    *router.urls,
]
