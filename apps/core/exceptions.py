"""One error shape for the whole API: ``{"error": code, "message": text, "fields": {...}}``.

``message`` always says what to fix; ``fields`` (validation errors only) maps each field to its messages,
so a client or the UI can show them next to the inputs.
"""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler

from apps.core.body_limits import RequestTooLarge, too_large_message


class Conflict(DjangoValidationError):
    """A refusal because of what else exists (HTTP 409 in the API; pages show it like any error): e.g. a step
    an ensemble depends on. ``message_dict`` names what conflicts."""


def _first_message(detail) -> str:
    if isinstance(detail, dict):
        for field, value in detail.items():
            text = _first_message(value)
            return text if field in ("non_field_errors", "__all__", "detail") else f"{field}: {text}"
        return "Invalid input."
    if isinstance(detail, list):
        return _first_message(detail[0]) if detail else "Invalid input."
    return str(detail)


def api_exception_handler(exc, context):
    if isinstance(exc, RequestDataTooBig):
        # Django's cap on request.body (JSON, forms): otherwise an HTML 400 page from Django itself.
        exc = RequestTooLarge(too_large_message(settings.DATA_UPLOAD_MAX_MEMORY_SIZE))
    elif isinstance(exc, TooManyFieldsSent | TooManyFilesSent):
        exc = exceptions.ValidationError({"non_field_errors": [f"{exc} Send fewer form fields or files."]})
    if isinstance(exc, Conflict):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        return Response(
            {"error": "conflict", "message": _first_message(detail), "fields": detail},
            status=status.HTTP_409_CONFLICT,
        )
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        exc = exceptions.ValidationError(detail)
    response = exception_handler(exc, context)
    if response is None:
        return None
    detail = response.data
    body: dict = {"error": getattr(exc, "default_code", "error")}
    if isinstance(exc, exceptions.ValidationError):
        fields = detail if isinstance(detail, dict) else {"non_field_errors": detail}
        body.update(error="invalid", message=_first_message(fields), fields=fields)
    elif isinstance(exc, exceptions.ParseError):
        body.update(
            message=f"{_first_message(detail)} Send a valid JSON body with Content-Type: application/json."
        )
    else:
        body["message"] = _first_message(detail)
    if response.status_code == status.HTTP_404_NOT_FOUND:
        body.update(error="not_found", message="Not found: no such object, or it is not visible to you.")
    return Response(body, status=response.status_code, headers=dict(response.headers))


def _wants_json(request) -> bool:
    return request.path.startswith("/api/")


def page_not_found(request, exception=None):
    """404 for URLs no view matched: JSON under /api/, the HTML page elsewhere."""
    from django.http import JsonResponse
    from django.views.defaults import page_not_found as html_page_not_found

    if _wants_json(request):
        return JsonResponse(
            {
                "error": "not_found",
                "message": f"No API endpoint at {request.path}; see /api/docs/ for the endpoints.",
            },
            status=404,
        )
    return html_page_not_found(request, exception)


def server_error(request):
    from django.http import JsonResponse
    from django.views.defaults import server_error as html_server_error

    if _wants_json(request):
        return JsonResponse(
            {
                "error": "server_error",
                "message": "The server failed to handle this request; it has been logged.",
            },
            status=500,
        )
    return html_server_error(request)
