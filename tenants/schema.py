"""OpenAPI (drf-spectacular) descriptions of the two ways to authenticate: API key and session."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "tenants.authentication.ApiKeyAuthentication"
    name = "apiKey"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "lp-<prefix>.<secret>",
            "description": "A tenant API key. The management API needs the `manage` scope; "
            "the inference gateway needs `inference`.",
        }


class TenantSessionAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "tenants.authentication.TenantSessionAuthentication"
    name = "session"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {
            "type": "apiKey",
            "in": "cookie",
            "name": "sessionid",
            "description": "A dashboard session of a tenant member (unsafe methods also need the CSRF token).",
        }
