"""OpenAPI description of the bearer token scheme (loaded in TeamsConfig.ready)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "apps.teams.authentication.BearerTokenAuthentication"
    name = "bearerToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "tgp_<prefix>_<secret>",
            "description": "A team API token, created under the team's settings and shown once.",
        }
