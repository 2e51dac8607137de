"""Routes of datasets and training jobs under /api/v1/ (see training.api)."""

from rest_framework.routers import SimpleRouter

from training.api import DatasetViewSet, TrainingJobViewSet

router = SimpleRouter()
# The attribute takes a regex, so `/datasets/1` and `/datasets/1/` both route (as in serving.registry.urls).
router.trailing_slash = "/?"
router.register("datasets", DatasetViewSet, basename="dataset")
router.register("training-jobs", TrainingJobViewSet, basename="training-job")

urlpatterns = router.urls
