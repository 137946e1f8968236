"""What a gateway cannot reach: HAProxy's statistics read into reasons, kept per gateway and instance, shown on
the host (API) and raised by the host-offline alert while the agent is still heard."""

from __future__ import annotations

from django.utils import timezone

from apps.alerts import services as alert_services
from apps.alerts.models import Alert, AlertKind, AlertRule, AlertState
from apps.fleet import services as fleet
from apps.fleet.models import GatewayReachability
from apps.gateway.runtime import unreachable_servers
from tests.support.models import add_instance

STAT = """# pxname,svname,qcur,scur,status,check_status,weight
s1,keya,0,0,DOWN,L4TOUT,100
s1,keyb,0,0,DOWN,L7STS,100
s1,keyc,0,0,MAINT,L4CON,0
g_s1,keya,0,0,DOWN,* L4CON,100
s2,keyd,0,0,UP,L7OK,100
"""


def test_only_servers_down_at_the_connection_are_unreachable():
    assert unreachable_servers(STAT) == {"keya": "health check failed: connection refused or failed (L4CON)"}
    assert unreachable_servers("Unknown command") == {}


def test_a_host_cut_from_the_gateway_is_shown_and_alerted_until_reached_again(
    owner_client, team, shared_host
):
    shared_host.team = team  # dedicated to the team: its alerts watch it
    shared_host.save()
    instance = add_instance(shared_host)
    rule = AlertRule.objects.create(team=team, kind=AlertKind.HOST_OFFLINE, name="hosts")
    fleet.record_gateway_reachability(
        "gw-1", {instance.api_key: "health check failed: connection timed out (L4TOUT)"}
    )
    since = GatewayReachability.objects.get().since
    fleet.record_gateway_reachability(
        "gw-1", {instance.api_key: "health check failed: connection timed out (L4TOUT)"}
    )
    assert GatewayReachability.objects.get().since == since  # first seen, kept

    body = owner_client.get(f"/api/v1/hosts/{shared_host.name}/").json()
    assert body["status"] == "online"
    assert (
        body["gateway_unreachable"][0]["gateway"] == "gw-1"
        and "L4TOUT" in body["gateway_unreachable"][0]["reason"]
    )
    alert_services.evaluate_rules()
    alert = Alert.objects.get(rule=rule, subject=f"host-gateway:{shared_host.pk}")
    assert "unreachable from gateway gw-1" in alert.summary

    fleet.record_gateway_reachability("gw-1", {})
    assert owner_client.get(f"/api/v1/hosts/{shared_host.name}/").json()["gateway_unreachable"] == []
    alert_services.evaluate_rules(now=timezone.now())
    alert.refresh_from_db()
    assert alert.state == AlertState.RESOLVED
