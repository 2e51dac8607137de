from django.apps import AppConfig


class ServingConfig(AppConfig):
    """The adapter registry: versions, canary, rollback, audit, usage records (the gateway reads them)."""

    name = "serving.registry"
    # The app was `serving` before it moved into serving/registry/: the label keeps its tables,
    # migrations, content types and permissions as they were.
    label = "serving"
    verbose_name = "Adapter registry and gateway"

    def ready(self) -> None:
        from serving.registry import schema  # noqa: F401  (registers the registry token's OpenAPI scheme)
