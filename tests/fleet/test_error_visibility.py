"""What each role sees of a host's errors: the instance log tail is for platform staff only (a shared
instance's log names every team's models, their load errors and host paths); tenants read their own
placement errors, and no error text a tenant reads carries a traceback or an absolute host path - those are
logged under an error id that the text shows."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from django.utils import timezone

from apps.deployments import services as deployment_services
from apps.deployments.models import PlacementState
from apps.fleet.models import Host, InstanceState, TritonInstance
from backend_ge.errors import public_error
from tests.conftest import client_for
from tests.factories import UserFactory
from tests.support.models import make_version

pytestmark = pytest.mark.django_db

LOG_TAIL = (
    "I0101 loading speech__asr from /srv/platform/var/fleet/local/cpu-0/repository/speech__asr\n"
    "E0101 load failed for model 'speech__asr': onnx error"
)
TRACEBACK_ERROR = (
    "loading model 'vision__classifier' failed (400): load failed for model 'vision__classifier': version 1 "
    "is at UNAVAILABLE state: Internal: Failed to initialize Python stub: ValueError: input 'x' has no dims\n\n"
    "At:\n  /srv/platform/var/fleet/local/cpu-0/repository/vision__classifier/1/model.py(41): initialize\n"
)
ERROR_ID = re.compile(r"error id ([0-9a-f]{12})")


@pytest.fixture
def shared_instance(db):
    host = Host.objects.create(name="local", address="127.0.0.1", last_heartbeat_at=timezone.now())
    return TritonInstance.objects.create(
        host=host, name="cpu-0", http_port=18100, grpc_port=18101, metrics_port=18102,
        state=InstanceState.READY, log_tail=LOG_TAIL,
    )  # fmt: skip


@pytest.fixture
def placements(shared_instance, owner, outsider, team, other_team):
    """A failed placement of each team on the shared instance."""
    from apps.registry.models import RegisteredModel

    result = {}
    for actor, tenant, slug in ((owner, team, "classifier"), (outsider, other_team, "asr")):
        model = RegisteredModel.objects.create(team=tenant, name=slug.title(), slug=slug, created_by=actor)
        version = make_version(model, 1)
        deployment = deployment_services.deploy_version(
            actor=actor, model=model, version=version, instances=[shared_instance]
        )
        deployment.placements.update(
            state=PlacementState.FAILED, last_error=public_error(f"{tenant.slug} model failed: bad dims")
        )
        result[tenant.slug] = deployment
    return result


def staff_session(client):
    client.force_login(UserFactory(username="ops", is_staff=True))
    return client


# --- the helper -----------------------------------------------------------------------------------------


def test_public_error_drops_the_traceback_and_paths_and_logs_them_under_the_id_it_shows(caplog):
    with caplog.at_level(logging.ERROR, logger="backend_ge.errors"):
        text = public_error(TRACEBACK_ERROR)
    assert "ValueError: input 'x' has no dims" in text and "/srv/" not in text and "At:" not in text
    error_id = ERROR_ID.search(text).group(1)
    logged = [r.getMessage() for r in caplog.records if error_id in r.getMessage()]
    assert len(logged) == 1 and "/srv/platform/var/fleet/local/cpu-0/repository" in logged[0]


def test_public_error_keeps_the_last_line_of_a_python_traceback_without_its_paths():
    try:
        Path("/srv/platform/var/artifacts/teams/2/models/7/versions/1/model/model.onnx").read_bytes()
    except OSError as exc:
        text = public_error(exc)
    assert text.startswith("[Errno 2] No such file or directory: '<path>'")
    assert "/srv/platform" not in text and ERROR_ID.search(text)


def test_public_error_leaves_a_clean_message_alone_and_logs_nothing(caplog):
    message = "the platform at http://127.0.0.1:8000 refused the manifest request (HTTP 403): wrong key"
    with caplog.at_level(logging.ERROR, logger="backend_ge.errors"):
        assert public_error(message) == message
        assert public_error(public_error(TRACEBACK_ERROR)).count("error id") == 1
    assert len(caplog.records) == 1  # only the one withheld traceback


def test_an_instance_error_reported_by_the_agent_has_no_host_path(shared_instance):
    from apps.fleet import services
    from tests.fleet.helpers import agent_client

    # Even an agent that sends the raw traceback (the agent itself sends public_error's summary) cannot
    # put a host path in front of tenants: the agent API summarizes it again.
    _, credential = services.join_host(services.issue_join_token(actor=None, host=shared_instance.host))
    agent = agent_client(credential)
    answer = agent.post(
        f"/agent/v1/instances/{shared_instance.pk}/state",
        {"state": InstanceState.STARTING, "last_error": TRACEBACK_ERROR},
        content_type="application/json",
    )
    assert answer.status_code == 200
    stored = TritonInstance.objects.get(pk=shared_instance.pk).last_error
    assert "/srv/" not in stored and "Failed to initialize Python stub" in stored and ERROR_ID.search(stored)


# --- the API ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("persona", ["owner", "viewer", "outsider"])
def test_tenants_get_no_log_tail_of_a_shared_instance(request, persona, shared_instance):
    client = client_for(request.getfixturevalue(persona))
    body = client.get(f"/api/v1/instances/{shared_instance.pk}/").json()
    assert body["log_tail"] is None
    host = client.get("/api/v1/hosts/local/").json()
    assert "log_tail" not in host["instances"][0]


def test_platform_staff_get_the_log_tail(client, shared_instance):
    body = staff_session(client).get(f"/api/v1/instances/{shared_instance.pk}/").json()
    assert body["log_tail"] == LOG_TAIL


def test_each_team_reads_only_its_own_placement_errors_on_a_shared_instance(
    owner_client, outsider_client, viewer_client, placements, shared_instance
):
    url = f"/api/v1/instances/{shared_instance.pk}/"
    for client, own, other in (
        (owner_client, "vision", "speech"),
        (viewer_client, "vision", "speech"),
        (outsider_client, "speech", "vision"),
    ):
        body = client.get(url).json()
        assert [d["team"] for d in body["deployments"]] == [own]
        assert body["deployments"][0]["last_error"] == f"{own} model failed: bad dims"
        assert other not in str(body)


def test_deployment_errors_and_events_show_an_error_id_not_the_traceback(owner_client, placements):
    from apps.deployments.models import DeploymentInstance

    deployment = placements["vision"]
    placement = DeploymentInstance.objects.get(deployment=deployment)
    message = public_error(TRACEBACK_ERROR)
    DeploymentInstance.objects.filter(pk=placement.pk).update(last_error=message)
    deployment.events.create(kind="load_failed", message=f"failed: {message}", instance=placement.instance)
    deployment_services.placement_finished(DeploymentInstance.objects.get(pk=placement.pk))
    body = owner_client.get(f"/api/v1/teams/vision/deployments/{deployment.pk}/").json()
    texts = [body["last_error"], body["placements"][0]["last_error"], body["events"][0]["message"]]
    for text in texts:
        assert "/srv/" not in text and "At:" not in text and ERROR_ID.search(text), text


# --- the page ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("persona", ["owner", "viewer", "outsider"])
def test_the_instance_page_hides_the_log_tail_from_tenants(request, client, persona, placements):
    client.force_login(request.getfixturevalue(persona))
    html = client.get("/hosts/local/instances/cpu-0/").content.decode()
    assert 'id="instance-log"' not in html and "speech__asr from" not in html
    own = "vision" if persona != "outsider" else "speech"
    other = "speech" if own == "vision" else "vision"
    assert f"{own} model failed: bad dims" in html and f"{other} model failed" not in html


def test_the_instance_page_shows_staff_the_log_tail(client, shared_instance):
    html = staff_session(client).get("/hosts/local/instances/cpu-0/").content.decode()
    assert '<pre class="log-tail" id="instance-log">I0101 loading speech__asr' in html
