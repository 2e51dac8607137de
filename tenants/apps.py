from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants, tiers and API keys"

    def ready(self) -> None:
        # Registers the OpenAPI descriptions of our authentication classes with drf-spectacular.
        from tenants import schema  # noqa: F401
        from tenants import receivers

        receivers.connect()
