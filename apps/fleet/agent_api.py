"""Endpoints for host agents on other machines: the manifest and files of a converted version.

Authenticated with ``X-Agent-Key`` (settings.AGENT_KEY) - agents are platform infrastructure, not team
members, so user tokens do not apply. Without a configured key the endpoints do not exist (404); a wrong key is a 403 that says so.
"""

from __future__ import annotations

import hmac
from functools import wraps
from pathlib import Path

from django.conf import settings
from django.http import FileResponse, Http404, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_GET

from apps.fleet.artifacts import AGENT_KEY_HEADER
from apps.fleet.repository import file_manifest
from apps.registry.models import ModelVersion, VersionState


class WrongAgentKey(Exception):
    """The request's X-Agent-Key is not the platform's."""


def _check_agent(request) -> None:
    if not settings.AGENT_KEY:
        raise Http404("no such agent endpoint")
    given = request.headers.get(AGENT_KEY_HEADER, "")
    if not hmac.compare_digest(given.encode(), settings.AGENT_KEY.encode()):
        # A 403 that says what to fix: a 404 would send the operator hunting for a missing version.
        raise WrongAgentKey


def agent_only(view):
    """Answer 403 with the fix when the key is wrong, 404 when the platform has no agent key at all."""

    @wraps(view)
    def wrapped(request, *args, **kwargs):
        try:
            _check_agent(request)
        except WrongAgentKey:
            return JsonResponse(
                {
                    "error": "forbidden",
                    "message": f"Wrong or missing {AGENT_KEY_HEADER}: the agent's AGENT_KEY must equal the platform's.",
                },
                status=403,
            )
        return view(request, *args, **kwargs)

    return wrapped


def _servable(version_id: int) -> Path:
    version = get_object_or_404(ModelVersion, pk=version_id, state=VersionState.READY)
    servable = version.servable_dir()
    if not servable.is_dir():
        raise Http404(f"{version} has no converted files")
    return servable


@require_GET
@agent_only
def version_manifest(request, version_id: int):
    return JsonResponse({"version": version_id, "files": file_manifest(_servable(version_id))})


@require_GET
@agent_only
def version_file(request, version_id: int, path: str):
    servable = _servable(version_id).resolve()
    target = (servable / path).resolve()
    # The path comes from the URL: it must stay inside the version's directory.
    if not target.is_relative_to(servable) or not target.is_file():
        raise Http404("no such file")
    return FileResponse(target.open("rb"), as_attachment=True, filename=target.name)
