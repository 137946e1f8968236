"""The gateway keeps a connection's token hash between its requests (``sess.`` variables in HAProxy): on one
keep-alive HTTP connection, and on one gRPC channel carrying several tokens, every request is still judged by
its own header, and a revocation or expiry reaches connections that are already open."""

from __future__ import annotations

import http.client
import json
import time
from contextlib import closing
from datetime import timedelta

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from django.utils import timezone
from tritonclient.utils import InferenceServerException

from apps.fleet.models import Host
from apps.registry.models import RegisteredModel
from apps.teams import services as team_services
from tests.conftest import wait_for
from tests.support.models import INFER_BODY
from tests.support.servers import deploy, ready_instance, requires_haproxy

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]


class Connection:
    """One keep-alive HTTP connection to the gateway; fails the test if it is ever reopened."""

    def __init__(self, port: int) -> None:
        self.http = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        self.socket = None

    def infer(self, model: str, token: str | None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        self.http.request("POST", f"/v2/models/{model}/infer", body=INFER_BODY, headers=headers)
        response = self.http.getresponse()
        body = json.loads(response.read() or b"{}")
        if self.socket is None:
            self.socket = self.http.sock
        assert self.http.sock is self.socket, "the gateway closed the keep-alive connection"
        return response.status, body

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def vision_and_speech(
    owner_client, outsider_client, owner, outsider, start_agent, make_scaler_version, team, other_team
):
    _, instance = ready_instance(start_agent, "shared-a")
    for client, owner_of, team_of in ((owner_client, owner, team), (outsider_client, outsider, other_team)):
        model = RegisteredModel.objects.create(
            team=team_of, name="Scaler", slug="scaler", created_by=owner_of
        )
        make_scaler_version(model, 2.0)
        deploy(client, team_of.slug, "scaler", 1, [instance])
    return instance


def test_each_request_on_a_keep_alive_connection_is_judged_by_its_own_token(
    vision_and_speech, start_gateway, make_token, owner, outsider, other_team
):
    gateway = start_gateway()
    token, secret = make_token(name="client")
    _, other_secret = make_token(name="second")
    _, speech_secret = team_services.create_token(actor=outsider, team=other_team, name="speech")
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 15, "the first routed request")
    wait_for(lambda: gateway.infer("speech__scaler", speech_secret)[0] == 200, 10, "the speech model")

    # Closed here even when an assertion fails (a failed test's traceback would keep it open past the test).
    with closing(Connection(gateway.port)) as connection:
        assert connection.infer("vision__scaler", secret)[0] == 200
        # A request without the header, or with a wrong secret behind the same prefix, after a valid one: 401.
        assert connection.infer("vision__scaler", None)[0] == 401
        assert connection.infer("vision__scaler", secret)[0] == 200
        assert connection.infer("vision__scaler", secret[:-2] + "xx")[0] == 401
        assert connection.infer("vision__scaler", "not-a-token")[0] == 401
        # Another team's token on the same connection: its own model only.
        assert connection.infer("vision__scaler", speech_secret)[0] == 404
        assert connection.infer("speech__scaler", speech_secret)[0] == 200
        assert connection.infer("speech__scaler", secret)[0] == 404
        assert connection.infer("vision__scaler", other_secret)[0] == 200
        assert connection.infer("vision__scaler", secret)[0] == 200

        # Revocation and expiry reach the open connection (the map is read on every request).
        team_services.revoke_token(actor=owner, token=token)
        revoked_at = time.monotonic()
        wait_for(lambda: connection.infer("vision__scaler", secret)[0] == 401, 5, "the revocation")
        assert time.monotonic() - revoked_at < 5
        _, short_secret = make_token(name="short", expires_at=timezone.now() + timedelta(seconds=5))
        wait_for(lambda: connection.infer("vision__scaler", short_secret)[0] == 200, 4, "the new token")
        status, body = wait_for(
            lambda: (r := connection.infer("vision__scaler", short_secret))[0] == 401 and r, 7, "the expiry"
        )
        assert body["error"] == "the API token has expired; create a new one"
        assert connection.infer("vision__scaler", other_secret)[0] == 200


def test_one_grpc_channel_with_several_tokens(
    owner_client, outsider_client, owner, outsider, team, other_team, start_agent, make_scaler_version,
    start_gateway, make_token,
):  # fmt: skip
    _, dedicated = ready_instance(start_agent, "vision-a")
    Host.objects.filter(name="vision-a").update(team=team)
    vision = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
    make_scaler_version(vision, 2.0)
    deploy(owner_client, "vision", "scaler", 1, [dedicated])
    gateway = start_gateway()
    _, vision_token = make_token(name="grpc")
    _, speech_token = team_services.create_token(actor=outsider, team=other_team, name="grpc")

    client = grpcclient.InferenceServerClient(gateway.grpc_url)  # one channel: one HTTP/2 connection
    data = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
    item = grpcclient.InferInput("input", list(data.shape), "FP32")
    item.set_data_from_numpy(data)

    def call(token: str | None) -> str:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        try:
            client.infer("vision__scaler", [item], headers=headers, client_timeout=10)
        except InferenceServerException as error:
            return error.status()
        return "OK"

    try:
        wait_for(lambda: call(vision_token) == "OK", 15, "gRPC routing")
        # Both tokens were made after the gateway's start: the other team's is known there once it is not a 401.
        wait_for(lambda: call(speech_token) != "StatusCode.UNAUTHENTICATED", 15, "the other team's token")
        assert call(None) == "StatusCode.UNAUTHENTICATED"
        assert call(vision_token) == "OK"
        assert call(vision_token[:-2] + "xx") == "StatusCode.UNAUTHENTICATED"
        # The other team's token never reaches this team's model: the same NOT_FOUND as a model that does not
        # exist (the gateway reads the model's name from the message).
        assert call(speech_token) == "StatusCode.NOT_FOUND"
        assert call(vision_token) == "OK"
    finally:
        client.close()
