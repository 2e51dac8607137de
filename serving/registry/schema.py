"""OpenAPI (drf-spectacular) description of the serving workers' registry token."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class RegistryTokenAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "serving.registry.api.RegistryTokenAuthentication"
    name = "registryToken"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "The platform's REGISTRY_TOKEN, shared with serving workers (internal endpoints only).",
        }
