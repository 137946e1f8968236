"""Inference-only tokens: the gateway takes them, the management API refuses them."""

from __future__ import annotations

import pytest

from apps.teams import services
from tests.conftest import bearer_client

pytestmark = pytest.mark.django_db


def test_inference_only_token_is_refused_by_the_management_api(owner, team):
    _, secret = services.create_token(actor=owner, team=team, name="edge", inference_only=True)
    response = bearer_client(secret).get("/api/v1/teams/")
    assert response.status_code == 403
    assert "inference-only" in response.json()["message"]


def test_owner_creates_an_inference_only_token_through_the_api(owner_client):
    response = owner_client.post(
        "/api/v1/teams/vision/tokens/", {"name": "edge", "inference_only": True}, format="json"
    )
    assert response.status_code == 201, response.json()
    assert response.json()["inference_only"] is True
    assert bearer_client(response.json()["token"]).get("/api/v1/teams/").status_code == 403


def test_team_token_still_uses_the_management_api(make_token):
    _, secret = make_token(name="ci")
    assert bearer_client(secret).get("/api/v1/teams/").status_code == 200
