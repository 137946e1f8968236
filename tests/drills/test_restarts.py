"""Restart drills: the platform's web process killed and started again while agents (in their own network
namespaces) load 20 models, and PostgreSQL restarted in the middle of a deploy - under gateway load, which
never depends on the control plane. Afterwards no deployment is left DEPLOYING, no report is lost (each
placement's row agrees with the Triton holding it), no replica is placed twice. The beat's scheduler tick is
driven by the test and stops while the platform is down, as beat would."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from django.db import connection
from django.db.utils import Error as DatabaseError

from apps.deployments.models import Deployment, DeploymentEvent, DeploymentState
from apps.registry.models import RegisteredModel
from tests.conftest import wait_for
from tests.drills.conftest import Stopwatch, record_figures
from tests.drills.helpers import Beat, deploy_models, duplicate_placements, reports_lost
from tests.support.servers import Load, request_pool_deployment, requires_haproxy

pytestmark = [
    pytest.mark.triton,
    pytest.mark.servers,
    requires_haproxy,
    pytest.mark.django_db(transaction=True),
]

MODELS = 20


def request_models(client, owner, team, make_scaler_version, count: int, prefix: str) -> list[int]:
    ids = []
    for n in range(count):
        slug = f"{prefix}-{n}"
        model = RegisteredModel.objects.create(team=team, name=slug, slug=slug, created_by=owner)
        make_scaler_version(model, 2.0)
        ids.append(request_pool_deployment(client, team.slug, slug, 1))
    return ids


def serving_count(ids: list[int]) -> int:
    return Deployment.objects.filter(pk__in=ids, state=DeploymentState.SERVING).count()


def surviving(predicate):
    """A wait_for predicate that survives the database going away under it: False until it is back."""

    def run():
        try:
            return predicate()
        except DatabaseError:
            connection.close()
            return False

    return run


def settle_and_measure(name: str, hosts, ids, beat: Beat, load: Load, clock: Stopwatch, **extra) -> dict:
    wait_for(surviving(beat.until(lambda: serving_count(ids) == len(ids))), 240,
             f"all {len(ids)} deployments SERVING\n{next(iter(hosts.values()))[0].output()}")  # fmt: skip
    converge_s = clock.lap()
    load.wait_for_requests(40)
    load.stop()
    return record_figures(
        name, sent=load.total, failed=load.total - load.statuses[200], converge_s=converge_s, **extra,
        duplicate_placements=duplicate_placements(), rows_lost=reports_lost(hosts),
    )  # fmt: skip


def assert_nothing_stuck_lost_or_doubled(row: dict, ids: list[int], load: Load) -> None:
    assert load.failures == [], load.failures[:5]
    stuck = Deployment.objects.filter(pk__in=ids).exclude(state=DeploymentState.SERVING)
    assert not stuck.exists(), list(stuck.values_list("pk", "state"))
    assert row["duplicate_placements"] == 0
    assert row["rows_lost"] == 0
    # No host was taken for lost because the platform could not hear it: nothing moved.
    assert not DeploymentEvent.objects.filter(kind="replica_lost").exists()


def test_platform_restarted_while_agents_load_20_models_leaves_nothing_deploying_or_lost(
    owner_client, owner, team, pool_of_net_hosts, platform_web, make_scaler_version, start_gateway, make_token
):
    hosts = pool_of_net_hosts(["host-a", "host-b"], budget_mb=8192)
    deploy_models(owner_client, owner, team, make_scaler_version, {"steady": 2})
    gateway = start_gateway()
    _, secret = make_token(name="load")
    wait_for(lambda: gateway.infer("vision__steady", secret)[0] == 200, 15, "the model to answer")
    beat = Beat()

    with Load(gateway, "vision__steady", secret, threads=2, rate=20, max_seconds=240) as load:
        clock = Stopwatch()
        ids = request_models(owner_client, owner, team, make_scaler_version, MODELS, "many")
        wait_for(beat.until(lambda: serving_count(ids) >= 3), 120, "the first models to load")
        # The web process dies with loads in flight (and beat stops); the agents keep loading and retry
        # their reports; inference goes on through the gateway.
        platform_web.kill()
        down = Stopwatch()
        wait_for(lambda: load.total > 0 and down.lap() >= 3, 10, "a 3 s outage")
        platform_web.start()
        row = settle_and_measure("platform restart while loading 20 models", hosts, ids, beat, load, clock,
                                 outage_s=3)  # fmt: skip
    assert_nothing_stuck_lost_or_doubled(row, ids, load)


@pytest.mark.skipif(
    not os.environ.get("DRILL_PG_DATA"),
    reason="restarts PostgreSQL: needs a private server (DRILL_PG_DATA, its data directory) - "
    "`python benchmarks/drills.py` starts one and runs this drill on it",
)
def test_postgres_restarted_mid_deploy_leaves_nothing_deploying_or_lost(
    owner_client, owner, team, pool_of_net_hosts, platform_web, make_scaler_version, start_gateway, make_token
):
    hosts = pool_of_net_hosts(["host-a", "host-b"], budget_mb=8192)
    deploy_models(owner_client, owner, team, make_scaler_version, {"steady": 2})
    gateway = start_gateway()
    _, secret = make_token(name="load")
    wait_for(lambda: gateway.infer("vision__steady", secret)[0] == 200, 15, "the model to answer")
    beat = Beat()

    with Load(gateway, "vision__steady", secret, threads=2, rate=20, max_seconds=240) as load:
        clock = Stopwatch()
        ids = request_models(owner_client, owner, team, make_scaler_version, 8, "mid")
        wait_for(beat.until(lambda: serving_count(ids) >= 2), 120, "the first models to load")
        connection.close()
        started = time.monotonic()
        subprocess.run(
            [os.path.join(os.environ.get("DRILL_PG_BIN", ""), "pg_ctl"), "restart", "-D", os.environ["DRILL_PG_DATA"], "-m", "fast", "-w", "-t", "60",
             "-l", os.path.join(os.environ["DRILL_PG_DATA"], "restart.log")],
            check=True, capture_output=True, timeout=90,
            **({"user": "postgres"} if os.geteuid() == 0 else {}),
        )  # fmt: skip
        restart_s = round(time.monotonic() - started, 2)
        row = settle_and_measure(
            "postgres restart mid-deploy", hosts, ids, beat, load, clock, postgres_restart_s=restart_s
        )
    assert_nothing_stuck_lost_or_doubled(row, ids, load)
