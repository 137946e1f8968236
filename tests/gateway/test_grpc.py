"""gRPC through the gateway: HAProxy cannot read the model name inside the protobuf body, so a team's gRPC goes
only to instances on hosts dedicated to that team - never to a shared instance - and is refused with
PERMISSION_DENIED for a team that has none."""

from __future__ import annotations

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from apps.fleet.models import Host
from apps.registry.models import RegisteredModel
from apps.teams import services as team_services
from tests.conftest import wait_for
from tests.support.servers import deploy, grpc_error, grpc_infer, ready_instance, requires_haproxy

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]


def test_grpc_reaches_only_the_teams_dedicated_instances(
    owner_client, outsider_client, owner, outsider, team, other_team, start_agent, make_scaler_version,
    start_gateway, make_token,
):  # fmt: skip
    _, shared = ready_instance(start_agent, "shared-a")
    _, dedicated = ready_instance(start_agent, "vision-a")
    Host.objects.filter(name="vision-a").update(team=team)
    vision = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
    speech = RegisteredModel.objects.create(
        team=other_team, name="Scaler", slug="scaler", created_by=outsider
    )
    make_scaler_version(vision, 2.0)
    make_scaler_version(speech, 3.0)
    deploy(owner_client, "vision", "scaler", 1, [dedicated])
    deploy(outsider_client, "speech", "scaler", 1, [shared])
    gateway = start_gateway()
    _, vision_token = make_token(name="grpc")
    _, speech_token = team_services.create_token(actor=outsider, team=other_team, name="grpc")

    # The team with a dedicated instance: its model answers over gRPC through the gateway.
    output = wait_for(
        lambda: _try(lambda: grpc_infer(gateway.grpc_url, "vision__scaler", vision_token).tolist()),
        15,
        "gRPC routing",
    )
    assert output == [[2.0, 4.0, 6.0, 8.0]]

    # Another team's model lives on a shared instance the gRPC route never reaches: Triton on the dedicated
    # instance does not know it.
    error = grpc_error(gateway.grpc_url, "speech__scaler", vision_token)
    assert "unknown model" in error.message() or "not found" in error.message()

    # A team without a dedicated instance: PERMISSION_DENIED with a message, never a shared instance.
    error = grpc_error(gateway.grpc_url, "speech__scaler", speech_token)
    assert error.status() == "StatusCode.PERMISSION_DENIED"
    assert "dedicated to your team" in error.message()

    # No or a wrong token: UNAUTHENTICATED.
    error = grpc_error(gateway.grpc_url, "vision__scaler", "tgp_0_wrong")
    assert error.status() == "StatusCode.UNAUTHENTICATED"

    # The control plane is not offered over gRPC either.
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    with pytest.raises(InferenceServerException) as caught:
        client.unload_model("vision__scaler", headers={"authorization": f"Bearer {vision_token}"})
    assert caught.value.status() == "StatusCode.UNIMPLEMENTED"
    client.close()


def _try(call):
    try:
        return call()
    except InferenceServerException:
        return None
