"""Pages of deploy by intent: the deploy form asks for replicas and a pool, the host page shows each
instance's capacity used/free and the replicas on it (another team's only counted) and drain progress, and
a pool page lists its hosts with their free capacity."""

from __future__ import annotations

import pytest
from django.utils import timezone

from apps.deployments import services
from apps.deployments.models import Deployment, PlacementState
from apps.fleet.models import Host, Pool, TritonInstance
from apps.registry.models import RegisteredModel
from tests.factories import UserFactory
from tests.support.models import add_instance, make_version

pytestmark = pytest.mark.django_db
NEW = "/teams/vision/deployments/new/"


@pytest.fixture
def web(client, owner):
    client.force_login(owner)
    return client


@pytest.fixture
def pool(db):
    return Pool.objects.create(name="cpu", memory_budget_mb=1000)


def pool_host(pool: Pool, name: str, port: int) -> TritonInstance:
    host = Host.objects.create(name=name, address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool)
    return add_instance(host, "cpu-0", port)


def sized(model, mb: int):
    version = make_version(model)
    version.footprint_mb = mb
    version.save(update_fields=["footprint_mb"])
    return version


def test_the_deploy_form_asks_for_replicas_and_a_pool_and_deploys_by_intent(web, model, pool):
    pool_host(pool, "h1", 18100)
    pool_host(pool, "h2", 18200)
    sized(model, 300)
    html = web.get(NEW).content.decode()
    assert 'name="placement" value="pool" checked' in html  # a pool exists: replicas are the default
    assert 'name="replicas"' in html and '<option value="cpu"' in html and "Any pool my team may use" in html
    answer = web.post(
        NEW, {"model": "classifier", "version": 1, "placement": "pool", "replicas": 2, "pool": "cpu"}
    )
    assert answer.status_code == 302, answer.content.decode()[-2000:]
    deployment = Deployment.objects.get(model=model)
    assert deployment.replicas == 2 and deployment.pool == pool and not deployment.pinned
    assert sorted(p.instance.host.name for p in deployment.placements.all()) == ["h1", "h2"]


@pytest.mark.parametrize(
    ("replicas", "message"), [(0, "greater than or equal to 1"), (10_000, "less than or equal")]
)
def test_the_deploy_form_refuses_bad_replicas_next_to_the_field(web, model, pool, replicas, message):
    sized(model, 300)
    answer = web.post(NEW, {"model": "classifier", "version": 1, "placement": "pool", "replicas": replicas})
    assert answer.status_code == 400 and message in answer.content.decode()
    assert not Deployment.objects.exists()


def test_the_host_page_shows_capacity_replicas_and_drain_progress(
    web, client, owner, team, other_team, model, pool
):
    ours = pool_host(pool, "h1", 18100)
    sized(model, 300)
    mine = services.deploy_version(
        actor=owner, model=model, version=model.versions.get(), replicas=1, pool=pool
    )
    theirs_model = RegisteredModel.objects.create(team=other_team, name="Secret", slug="secret-model")
    theirs = services.deploy_version(actor=None, model=theirs_model, version=sized(theirs_model, 200), replicas=1,
                                     pool=pool)  # fmt: skip
    html = web.get("/hosts/h1/").content.decode()
    row = html.split(f'data-instance="{ours.name}"', 1)[1].split("</tr>", 1)[0]
    assert "500 MiB / 500 MiB" in row and "of 1000 MiB" in row  # used / free of the capacity
    assert "vision/classifier" in row and "1 of other teams" in row and "secret-model" not in html
    assert '<a href="/pools/cpu/">cpu</a>' in html and "schedulable" in html

    Host.objects.filter(pk=ours.host_id).update(cordoned_at=timezone.now(), draining_at=timezone.now())
    mine.placements.update(retiring_reason="host h1 is draining")
    html = web.get("/hosts/h1/").content.decode()
    assert (
        'id="drain-progress"' in html
        and "<strong>2</strong> replicas still on this host, 1 moving now" in html
    )
    for d in (mine, theirs):
        d.placements.update(state=PlacementState.UNLOADED)
    assert "Drained: no replica left" in web.get("/hosts/h1/").content.decode()


def test_staff_drain_and_uncordon_from_the_host_page(client, pool):
    pool_host(pool, "h1", 18100)
    client.force_login(UserFactory(is_staff=True))
    assert client.post("/hosts/h1/", {"op": "drain"}).status_code == 302
    host = Host.objects.get(name="h1")
    assert host.cordoned_at and host.draining_at
    client.post("/hosts/h1/", {"op": "uncordon"})
    host.refresh_from_db()
    assert host.cordoned_at is None and host.draining_at is None


def test_a_member_may_not_drain(web, pool):
    pool_host(pool, "h1", 18100)
    assert web.post("/hosts/h1/", {"op": "drain"}).status_code == 403
    assert Host.objects.get(name="h1").draining_at is None


def test_the_pool_page_lists_hosts_and_free_capacity_and_hides_other_teams_pools(
    web, owner, model, pool, other_team
):
    pool_host(pool, "h1", 18100)
    pool_host(pool, "h2", 18200)
    Host.objects.filter(name="h2").update(cordoned_at=timezone.now())
    services.deploy_version(actor=owner, model=model, version=sized(model, 400), replicas=1, pool=pool)
    html = web.get("/pools/cpu/").content.decode()
    assert 'data-host="h1"' in html and 'data-host="h2"' in html
    h1 = html.split('data-host="h1"', 1)[1].split("</tr>", 1)[0]
    assert "400 MiB" in h1 and "600 MiB" in h1 and "schedulable" in h1
    assert "cordoned" in html.split('data-host="h2"', 1)[1].split("</tr>", 1)[0]
    # Free on schedulable hosts only: h2 is cordoned.
    capacity = html.split('id="pool-capacity">', 1)[1].split("</dd>", 1)[0]
    assert capacity == "600 MiB free on schedulable hosts, of 2 GiB", capacity
    Pool.objects.create(name="speech-only", team=other_team)
    assert web.get("/pools/speech-only/").status_code == 404


def test_staff_set_the_pool_s_placement_policy_on_its_page_and_a_member_may_not(web, client, pool):
    html = web.get("/pools/cpu/").content.decode()
    assert (
        "<strong>spread</strong>" in html.split('id="pool-policy"', 1)[1] and "pool-policy-form" not in html
    )
    assert web.post("/pools/cpu/", {"placement_policy": "binpack"}).status_code == 403
    client.force_login(UserFactory(is_staff=True))
    assert client.post("/pools/cpu/", {"placement_policy": "tightest"}).status_code == 400
    assert client.post("/pools/cpu/", {"placement_policy": "binpack"}).status_code == 302
    pool.refresh_from_db()
    assert pool.placement_policy == "binpack"
    html = client.get("/pools/cpu/").content.decode()
    assert "<strong>binpack</strong>" in html and "most loaded instance that still fits" in html
