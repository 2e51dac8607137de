from django.apps import AppConfig


class ServingConfig(AppConfig):
    """The adapter registry and the inference gateway. `serving.engine` beside it is Django-free."""

    name = "serving"
    verbose_name = "Adapter registry and gateway"

    def ready(self) -> None:
        from serving import schema  # noqa: F401  (registers the registry token's OpenAPI scheme)
