"""OpenAPI: the error responses every operation can give, declared in one place.

Each endpoint documents its success answer (and any error it wants to describe in its own words); this
drf-spectacular postprocessing hook adds the errors that the platform's common machinery produces, in the
one error shape of ``apps.core.exceptions``:

- 401: every operation needs a session or an API token;
- 403: roles (viewer < maintainer < owner), read-only tokens, staff-only actions;
- 404: an operation with path parameters (another team's object is a 404, never a 403), or with pages;
- 400: every change (validation, business rules such as "a team keeps an owner") and every read with
  query parameters (filters, ordering, pages);
- 413, 415: an operation with a request body (Django's body cap, the upload and playground limits; a
  content type it does not parse).
"""

from __future__ import annotations

ERROR_SCHEMA = {
    "type": "object",
    "description": "The platform's one error shape.",
    "properties": {
        "error": {"type": "string", "description": "A short machine-readable code, e.g. invalid, not_found."},
        "message": {"type": "string", "description": "What went wrong and what to do about it."},
        "fields": {
            "type": "object",
            "additionalProperties": True,
            "description": "Validation errors only: messages per field.",
        },
    },
    "required": ["error", "message"],
    "additionalProperties": True,
}

DESCRIPTIONS = {
    "400": "Invalid input; `fields` names each offending field.",
    "401": "No valid session or API token.",
    "403": "The caller's role, token or staff status does not allow this.",
    "404": "No such object, or it is not visible to the caller.",
    "413": "The request body is larger than this endpoint accepts.",
    "415": "The request's content type is not one this endpoint parses.",
}
HTTP_METHODS = ("get", "put", "post", "patch", "delete")


def _error_codes(path: str, method: str, operation: dict) -> list[str]:
    codes = ["401", "403"]
    parameters = operation.get("parameters", [])
    if "{" in path or any(p.get("name") == "page" for p in parameters):
        codes.append("404")  # an object that is not there or not visible; a page past the last one
    if method != "get" or any(p.get("in") == "query" for p in parameters):
        codes.append("400")
    if "requestBody" in operation:
        codes += ["413", "415"]
    return codes


def declare_error_responses(result: dict, generator, request, public) -> dict:
    """Add the common error responses to every operation that does not describe them itself."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    reference = {"$ref": "#/components/schemas/Error"}
    for path, item in result.get("paths", {}).items():
        for method in HTTP_METHODS:
            operation = item.get(method)
            if operation is None:
                continue
            responses = operation.setdefault("responses", {})
            for code in _error_codes(path, method, operation):
                responses.setdefault(
                    code,
                    {
                        "description": DESCRIPTIONS[code],
                        "content": {"application/json": {"schema": reference}},
                    },
                )
    return result
