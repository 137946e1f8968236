"""The first reading of a tritonserver its agent started counts from zero; a process of unknown start is only
the baseline. Never a count twice: the same process again keeps deltas, a failed scrape changes nothing, a
pid reused by another start is a new process, and final counts folded before the first scrape stay folded.

Readings are Prometheus text in Triton's format (``test_final_counts.text``), parsed by the scraper's parser;
the real agent and tritonserver are in ``test_counting_from_start_live.py``.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.fleet import services as fleet_services
from apps.fleet.models import TritonInstance
from apps.monitoring.models import ScrapeState
from apps.monitoring.scraper import Fetched, ModelNames, record_scrape
from apps.monitoring.services import record_final_counts
from backend_ge import triton_metrics
from hostagent import protocol
from tests.monitoring.test_final_counts import T0, counted, report, served_mlp, text

pytestmark = pytest.mark.django_db
STARTED = T0 - timedelta(seconds=30)


@pytest.fixture
def setup(team, owner):
    return served_mlp(team, owner)


def scrape(instance, counts, at, server="100", started=STARTED, error=""):
    """One scrape as the scraper records it: ``started`` is what the instance row said of the process."""
    reading = None if error else triton_metrics.parse_metrics(text(counts))
    fetched = Fetched(instance, at, server, reading, error, server_started_at=started)
    return record_scrape(fetched, ModelNames.load(), now=at)


def test_the_first_reading_of_a_process_the_agent_started_counts_everything(setup):
    instance, v1 = setup["instance"], setup["versions"][1]
    scrape(instance, {"1": 300}, T0)
    assert counted(v1) == (300, 30)


def test_the_first_reading_of_a_process_of_unknown_start_is_only_the_baseline(setup):
    instance, v1 = setup["instance"], setup["versions"][1]
    scrape(instance, {"1": 300}, T0, started=None)
    assert counted(v1) == (0, 0)
    scrape(instance, {"1": 310}, T0 + timedelta(seconds=15), started=None)
    assert counted(v1) == (10, 1)


def test_the_same_process_seen_again_keeps_deltas(setup):
    instance, v1 = setup["instance"], setup["versions"][1]
    scrape(instance, {"1": 300}, T0)
    scrape(instance, {"1": 300}, T0 + timedelta(seconds=15))
    scrape(instance, {"1": 350}, T0 + timedelta(seconds=30))
    assert counted(v1) == (350, 35)


def test_a_failed_scrape_then_a_good_one_counts_each_request_once(setup):
    instance, v1 = setup["instance"], setup["versions"][1]
    scrape(instance, {}, T0, error="URLError: refused")
    assert not ScrapeState.objects.get(instance=instance).has_baseline
    scrape(instance, {"1": 300}, T0 + timedelta(seconds=15))
    scrape(instance, {}, T0 + timedelta(seconds=30), error="URLError: refused")
    scrape(instance, {"1": 320}, T0 + timedelta(seconds=45))
    assert counted(v1) == (320, 32)


def test_an_older_reading_applied_after_a_newer_one_counts_nothing(setup):
    instance, v1 = setup["instance"], setup["versions"][1]
    scrape(instance, {"1": 300}, T0 + timedelta(seconds=15))
    scrape(instance, {"1": 290}, T0)  # an overlapping cycle's older read, recorded late
    assert counted(v1) == (300, 30)


def test_a_pid_reused_by_another_start_is_a_new_process_counted_from_zero(setup):
    instance, v1 = setup["instance"], setup["versions"][1]
    scrape(instance, {"1": 300}, T0)
    # Restarted with the same pid (a container's pid namespace): 40 requests since, below nothing seen.
    scrape(instance, {"1": 340}, T0 + timedelta(seconds=60), started=T0 + timedelta(seconds=30))
    assert counted(v1) == (640, 64)
    scrape(instance, {"1": 345}, T0 + timedelta(seconds=75), started=T0 + timedelta(seconds=30))
    assert counted(v1) == (645, 64)


def test_a_counter_that_went_down_is_a_restart(setup):
    instance, v1 = setup["instance"], setup["versions"][1]
    scrape(instance, {"1": 300}, T0)
    scrape(instance, {"1": 20}, T0 + timedelta(seconds=15))  # reloaded: 20 since
    assert counted(v1) == (320, 32)


def test_final_counts_folded_before_the_first_scrape_are_not_counted_again(setup):
    instance, v2 = setup["instance"], setup["versions"][2]
    # v2 served 30 and was unloaded before the scraper first read the process; then reloaded and served 5.
    record_final_counts(
        instance.pk, report({"2": 30}, T0 + timedelta(seconds=5)), now=T0 + timedelta(seconds=6)
    )
    assert counted(v2) == (30, 3)
    scrape(instance, {"2": 5}, T0 + timedelta(seconds=15))
    assert counted(v2) == (35, 3)


def test_final_counts_of_an_older_process_with_the_same_pid_are_not_its_baseline(setup):
    instance, v1 = setup["instance"], setup["versions"][1]
    # Folded for the process started at STARTED, read before the new process (same pid) started.
    record_final_counts(instance.pk, report({"1": 300}, T0), now=T0 + timedelta(seconds=1))
    assert counted(v1) == (300, 30)
    scrape(instance, {"1": 350}, T0 + timedelta(seconds=30), started=T0 + timedelta(seconds=10))
    assert counted(v1) == (650, 65)


def test_counter_deltas_from_a_started_baseline_count_every_counter():
    counters = {("m", "1"): {"success": 3.0, "request_us": 90.0}, ("m", "2"): {"success": 0.0}}
    assert triton_metrics.counter_deltas(None, "7", counters) == {}
    assert triton_metrics.counter_deltas(triton_metrics.started_baseline("7"), "7", counters) == {
        ("m", "1"): {"success": 3.0, "request_us": 90.0}
    }


def test_the_agent_reports_when_it_started_a_server_and_a_pid_without_it_is_of_unknown_start(setup):
    instance = setup["instance"]
    at = (T0 - timedelta(minutes=1)).isoformat()
    fields = protocol.check_instance_report({"state": "READY", "pid": 4321, "started_at": at})
    fleet_services.record_instance_state(instance, **fields)
    instance = TritonInstance.objects.get(pk=instance.pk)
    assert (instance.pid, instance.server_started_at) == (4321, T0 - timedelta(minutes=1))
    fleet_services.record_instance_state(instance, **protocol.check_instance_report({"pid": 4400}))
    assert TritonInstance.objects.get(pk=instance.pk).server_started_at is None


@pytest.mark.parametrize("value", ["2026-11-30T12:00:00", "yesterday", 1700000000, "9" * 100])
def test_a_start_time_without_its_offset_or_not_a_time_is_refused(value):
    with pytest.raises(protocol.ProtocolError, match="started_at"):
        protocol.check_instance_report({"pid": 5, "started_at": value})
