"""What the gateway is told to route, read from the database (no HAProxy needed)."""

from __future__ import annotations

import pytest

from apps.fleet import services as fleet_services
from apps.gateway.state import backend_name, desired_state
from tests.support.models import add_instance, serving_rows

pytestmark = pytest.mark.django_db


def test_a_revoked_hosts_instances_leave_rotation_while_the_others_stay(
    team,
    owner,
    admin_user,
    shared_host,
):
    trusted = add_instance(shared_host, "cpu-0", port=18100)
    edge, _ = fleet_services.create_host(actor=admin_user, name="edge-1", address="127.0.0.2")
    revoked = add_instance(edge, "cpu-0", port=18200)
    deployment = serving_rows(team, owner, "a", trusted)
    deployment.placements.create(instance=revoked, served_version=deployment.active_version, state="READY")
    name = backend_name(deployment.pk)
    before = desired_state().weights
    assert before[(name, trusted.api_key)] == 100 and before[(name, revoked.api_key)] == 100

    fleet_services.revoke_host(actor=admin_user, host=edge)
    after = desired_state().weights
    assert after[(name, trusted.api_key)] == 100
    assert after[(name, revoked.api_key)] == 0
