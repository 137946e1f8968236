"""Endpoints for host agents on other machines: the manifest and files of a converted version.

Authenticated with ``X-Agent-Key`` (settings.AGENT_KEY) - agents are platform infrastructure, not team
members, so user tokens do not apply. Without a configured key the endpoints do not exist (404).
"""

from __future__ import annotations

import hmac
from pathlib import Path

from django.conf import settings
from django.http import FileResponse, Http404, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_GET

from apps.fleet.artifacts import AGENT_KEY_HEADER
from apps.fleet.repository import file_manifest
from apps.registry.models import ModelVersion, VersionState


def _check_agent(request) -> None:
    given = request.headers.get(AGENT_KEY_HEADER, "")
    if not settings.AGENT_KEY or not hmac.compare_digest(given.encode(), settings.AGENT_KEY.encode()):
        raise Http404("no such agent endpoint")


def _servable(version_id: int) -> Path:
    version = get_object_or_404(ModelVersion, pk=version_id, state=VersionState.READY)
    servable = version.servable_dir()
    if not servable.is_dir():
        raise Http404(f"{version} has no converted files")
    return servable


@require_GET
def version_manifest(request, version_id: int):
    _check_agent(request)
    return JsonResponse({"version": version_id, "files": file_manifest(_servable(version_id))})


@require_GET
def version_file(request, version_id: int, path: str):
    _check_agent(request)
    servable = _servable(version_id).resolve()
    target = (servable / path).resolve()
    # The path comes from the URL: it must stay inside the version's directory.
    if not target.is_relative_to(servable) or not target.is_file():
        raise Http404("no such file")
    return FileResponse(target.open("rb"), as_attachment=True, filename=target.name)
