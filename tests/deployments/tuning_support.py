"""Rows and reports shared by the tuning jobs' tests (no servers)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from apps.fleet.models import Host, Pool
from backend_ge import config as gc
from backend_ge.tuning import Candidate, Point
from tests.support.models import CLASSIFIER_SIGNATURE, add_instance, make_version

BASE = Candidate(True, 8, 100, (4,), 1)
BETTER = Candidate(True, 8, 1000, (8,), 1)


def url(team: str = "vision") -> str:
    return f"/api/v1/teams/{team}/tunings/"


@pytest.fixture
def pool(db):
    pool = Pool.objects.create(name="cpu", memory_budget_mb=1000)
    for i in range(2):
        host = Host.objects.create(
            name=f"h{i}", address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool
        )
        add_instance(host, "cpu-0", 18100 + 10 * i)
    return pool


@pytest.fixture
def tunable(model):
    """A READY version (footprint 300 MiB) of a model with a latency objective."""
    model.objective_p99_ms = 20
    model.save(update_fields=["objective_p99_ms"])
    version = make_version(model, 1)
    cfg = gc.generate_config(
        model.triton_model_name(),
        gc.ModelSignature.from_dict(CLASSIFIER_SIGNATURE),
        max_batch_size=8,
        preferred_batch_sizes=(4,),
        max_queue_delay_us=100,
    )
    version.config_text = gc.render_config(cfg)
    version.footprint_mb = 300
    version.save(update_fields=["config_text", "footprint_mb"])
    return version


def start(client, **body):
    return client.post(url(), {"model": "classifier", "version": 1, **body}, format="json")


def credential_of(host: Host) -> str:
    from apps.fleet import services as fleet_services

    token = fleet_services.issue_join_token(actor=None, host=host)
    return fleet_services.join_host(token)[1]


def point(candidate: Candidate, concurrency: int, rps: float, p99: float, at: float = 1.0) -> dict:
    return {**Point(candidate, concurrency, rps, p99 / 2, p99).as_dict(), "at_s": at}
