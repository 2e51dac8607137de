from django.apps import AppConfig


class LoraPlatformConfig(AppConfig):
    """Registers the project package as an app so its management commands are found."""

    name = "lora_platform"
    verbose_name = "Loraplex platform"
