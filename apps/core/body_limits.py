"""Per-view limits on the size of a request body, enforced before anything reads the body.

Django caps form fields (DATA_UPLOAD_MAX_MEMORY_SIZE) but streams file parts to disk without a limit, and a
view with its own parser (the playground's JSON) reads what it is sent. A view that accepts a large body
names the setting that bounds it with ``@limit_body("SETTING")`` (on a DRF action or a page view class);
``BodyLimitMiddleware`` compares the declared Content-Length with it in ``process_view`` - before the CSRF
check parses a form - and answers 413 in the API's error shape (JSON under /api/) or through the view's own
``body_too_large`` hook. Without a Content-Length Django reads no body at all, so the header is the size.
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework import exceptions, status

LIMIT_ATTRIBUTE = "body_limit_setting"
HINT_ATTRIBUTE = "body_limit_hint"
PLAYGROUND_HINT = (
    "Send smaller inputs (a .npy file is far smaller than JSON numbers), or call the model through its "
    "endpoint with tritonclient for big inputs."
)


class RequestTooLarge(exceptions.APIException):
    """413 in the API's error shape (apps.core.exceptions): the body is larger than the endpoint accepts.
    Defined here, not in apps.core.exceptions: that module imports DRF's views, which load the parsers."""

    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "too_large"
    default_detail = "The request body is too large."


def limit_body(setting_name: str, hint: str = "") -> Callable:
    """Mark a view function, a DRF action or a view class as accepting at most ``settings.<setting_name>``
    bytes of body; ``hint`` tells the client what to do instead."""

    def mark(target):
        setattr(target, LIMIT_ATTRIBUTE, setting_name)
        setattr(target, HINT_ATTRIBUTE, hint)
        return target

    return mark


def too_large_message(limit: int, length: int | None = None, hint: str = "") -> str:
    size = f" (this one is {length / 2**20:.1f} MiB)" if length else ""
    text = f"The request body is larger than the {limit / 2**20:g} MiB this endpoint accepts{size}."
    return f"{text} {hint}" if hint else text


def _target(view_func, method: str):
    """The object a limit may be declared on: the DRF action, the view class, or the function."""
    cls = getattr(view_func, "cls", None)  # DRF: APIView.as_view / ViewSet.as_view
    if cls is not None:
        actions = getattr(view_func, "actions", None) or {}
        handler = getattr(cls, actions.get(method.lower(), method.lower()), None)
        return handler if getattr(handler, LIMIT_ATTRIBUTE, None) else cls
    return getattr(view_func, "view_class", None) or view_func


class BodyLimitMiddleware:
    """Refuses a body larger than its view's declared limit with 413 before it is read."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_view(self, request: HttpRequest, view_func, view_args, view_kwargs):
        target = _target(view_func, request.method or "GET")
        setting_name = getattr(target, LIMIT_ATTRIBUTE, None)
        if not setting_name:
            return None
        limit = getattr(settings, setting_name)
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if length <= limit:
            return None
        message = too_large_message(limit, length, getattr(target, HINT_ATTRIBUTE, ""))
        hook = getattr(target, "body_too_large", None)
        if hook is not None:
            return hook(request, message)
        return JsonResponse({"error": "too_large", "message": message}, status=413)
