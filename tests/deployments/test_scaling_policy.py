"""The autoscaler's decision function (``apps.deployments.scaling_policy.decide``): pure, no database."""

from __future__ import annotations

import pytest

from apps.deployments.scaling_policy import Memory, Observation, Policy, decide, recommend, window_in_flight

POLICY = Policy(min_replicas=1, max_replicas=10, target=4, down_window_s=300, idle_period_s=900)


def run(policy: Policy, current: int, samples: list[tuple[float, float, int | None]], memory=None):
    """Feed observations (at, in_flight, total) in order, applying each decision; returns the replicas after
    each step and the last decision."""
    seen, decision = [], None
    for at, in_flight, total in samples:
        decision = decide(policy, current, Observation(at, in_flight, total), memory)
        memory, current = decision.memory, decision.replicas
        seen.append(current)
    return seen, decision


@pytest.mark.parametrize(
    ("in_flight", "expected"),
    [(0, 1), (0.5, 1), (4, 1), (4.01, 2), (8, 2), (19.2, 5), (39.9, 10), (400, 10)],
)
def test_recommend_is_the_load_over_the_target_within_the_bounds(in_flight, expected):
    assert recommend(POLICY, in_flight) == expected


def test_scale_up_is_immediate_and_says_the_figures():
    decision = decide(POLICY, 3, Observation(1000, 57.6, 10))
    assert decision.replicas == 10  # 15 wanted, capped at max
    decision = decide(POLICY, 3, Observation(1000, 19.2, 10))
    assert decision.replicas == 5
    assert decision.message == "3 -> 5 replicas: 6.4 in flight per replica, target 4"


def test_the_message_names_the_per_replica_load():
    decision = decide(POLICY, 1, Observation(0, 19.2, 1))
    assert decision.message == "1 -> 5 replicas: 19.2 in flight per replica, target 4"


def test_no_change_no_message():
    decision = decide(POLICY, 2, Observation(0, 6, 1))
    assert decision.replicas == 2 and not decision.changed


def test_scale_down_waits_for_a_whole_window():
    # Load drops from 5 replicas' worth to 1 at t=0; the memory starts at t=0 (fresh autoscaler).
    samples = [(t, 2.0, t) for t in range(0, 301, 5)]
    seen, _ = run(POLICY, 5, samples)
    assert all(n == 5 for n in seen[:-1]), seen  # a fresh memory does not cover the window: held
    assert seen[-1] == 1


def test_scale_down_after_the_window_goes_to_the_highest_recent_recommendation():
    samples = (
        [(0, 20.0, 0)] + [(t, 12.0, t) for t in range(5, 200, 5)] + [(t, 3.0, t) for t in range(200, 700, 5)]
    )
    seen, decision = run(POLICY, 1, samples)
    assert seen[0] == 5
    # 12 in flight -> 3 replicas are recommended from t=5; 5 (in effect until t=5) stays a whole window.
    assert seen[samples.index((300, 3.0, 300))] == 5
    assert seen[samples.index((305, 3.0, 305))] == 3
    # 3 in flight -> 1 replica from t=200: down to 1 at t=500.
    assert seen[samples.index((495, 3.0, 495))] == 3
    assert seen[samples.index((500, 3.0, 500))] == 1
    assert (
        "the highest over the last 300 s"
        in decide(POLICY, 3, Observation(1000, 0, 1000), decision.memory).message
    )


def test_bursts_shorter_than_the_window_do_not_flap():
    # A burst of 30 in flight for 10 s every 2 minutes, idle in between, for an hour.
    samples = []
    for t in range(0, 3600, 5):
        samples.append((t, 30.0 if t % 120 < 10 else 0.0, t))
    seen, _ = run(POLICY, 1, samples)
    assert set(seen) == {8}, seen[:40]  # up to 8 at the first burst, and stays: no flapping


def test_up_and_down_within_the_window_changes_once_each_way():
    samples = [(t, 16.0, t) for t in range(0, 60, 5)] + [(t, 0.0, 100) for t in range(60, 800, 5)]
    seen, _ = run(POLICY, 1, samples)
    assert seen[0] == 4
    changes = [(i, seen[i]) for i in range(1, len(seen)) if seen[i] != seen[i - 1]]
    assert len(changes) == 1 and changes[0][1] == 1
    # Down only after the whole window since the last time 4 were recommended (t=55).
    assert samples[changes[0][0]][0] >= 55 + 300


def test_min_and_max_bound_every_decision():
    policy = Policy(min_replicas=2, max_replicas=3, target=4)
    assert decide(policy, 2, Observation(0, 100, 1)).replicas == 3
    assert decide(policy, 2, Observation(0, 0, 1)).replicas == 2
    # A lowered maximum applies at once, not after the window.
    assert decide(policy, 6, Observation(0, 0, 1)).replicas == 3
    # A raised minimum too.
    assert decide(Policy(min_replicas=4, max_replicas=8), 2, Observation(0, 0, 1)).replicas == 4


def test_scale_to_zero_after_the_idle_period_only():
    policy = Policy(min_replicas=0, max_replicas=4, target=4, down_window_s=60, idle_period_s=900)
    samples = [(t, 0.0, 7) for t in range(0, 901, 10)]
    seen, decision = run(policy, 1, samples)
    assert seen[:-1] == [1] * (len(samples) - 1)
    assert seen[-1] == 0
    assert decision.message == "1 -> 0 replicas: no request for 900 s (idle period 900 s)"


def test_a_request_between_observations_resets_the_idle_period():
    policy = Policy(min_replicas=0, max_replicas=4, idle_period_s=900)
    samples = [(t, 0.0, 7) for t in range(0, 500, 10)] + [(t, 0.0, 8) for t in range(500, 1300, 10)]
    seen, _ = run(policy, 1, samples)
    assert 0 not in seen  # the request count changed at t=500: asleep only from t=1400
    seen, _ = run(policy, 1, [(t, 0.0, 8) for t in range(1300, 1401, 10)], _memory_after(policy, samples))
    assert seen[-1] == 0


def _memory_after(policy, samples):
    memory, current = None, 1
    for at, in_flight, total in samples:
        decision = decide(policy, current, Observation(at, in_flight, total), memory)
        memory, current = decision.memory, decision.replicas
    return memory


def test_min_one_never_sleeps():
    seen, _ = run(POLICY, 1, [(t, 0.0, 1) for t in range(0, 5000, 50)])
    assert set(seen) == {1}


def test_asleep_stays_asleep_without_requests_and_wakes_with_them():
    policy = Policy(min_replicas=0, max_replicas=4)
    assert decide(policy, 0, Observation(0, 0, 3)).replicas == 0
    decision = decide(policy, 0, Observation(0, 9, 3))
    assert decision.replicas == 3 and decision.message.startswith("0 -> 3 replicas")


def test_in_flight_requests_keep_a_deployment_awake_whatever_the_count():
    policy = Policy(min_replicas=0, max_replicas=4, idle_period_s=10)
    seen, _ = run(policy, 1, [(t, 1.0, None) for t in range(0, 100, 5)])
    assert set(seen) == {1}


def test_the_callers_memory_is_not_changed():
    memory = Memory(recommendations=[[0.0, 3]], last_total=1, last_traffic_at=0.0)
    decide(POLICY, 3, Observation(10, 40, 5), memory)
    assert memory.recommendations == [[0.0, 3]] and memory.last_total == 1


def test_memory_round_trips_and_stays_small():
    seen, decision = run(POLICY, 1, [(t, float(t % 37), t) for t in range(0, 20000, 5)])
    again = Memory.load(decision.memory.dump())
    assert again == decision.memory
    assert len(again.recommendations) <= 300 // 5 + 2


# --- The load is an average over the evaluation interval, not one snapshot -------------------------------


def test_a_momentary_spike_in_one_snapshot_does_not_scale_up():
    # 2 requests/s of 0.5 s each: 1 in flight on average; one snapshot catches 40 (a spike between looks).
    seen, decision = run_timed(POLICY, 1, [(0, 1, 0), (3, 1, 6), (6, 40, 12), (9, 1, 18)])
    assert seen == [1, 1, 1, 1], decision.memory.dump()
    assert decision.in_flight == pytest.approx(1.0)


def test_a_snapshot_in_a_gap_between_requests_does_not_count_as_idle_or_scale_down():
    # 40 requests/s of 0.5 s each: 20 in flight on average; a snapshot falls where none was in flight.
    seen, decision = run_timed(POLICY, 5, [(0, 20, 0), (3, 20, 120), (6, 0, 240), (9, 20, 360)])
    assert seen == [5, 5, 5, 5]
    policy = Policy(min_replicas=0, max_replicas=10, target=4, down_window_s=0, idle_period_s=5)
    seen, decision = run_timed(policy, 5, [(0, 20, 0), (3, 0, 120), (6, 0, 240), (9, 0, 360)])
    assert seen == [5, 5, 5, 5]  # never asleep: requests went through each interval


def test_a_sustained_load_scales_up_even_before_requests_finish():
    # Requests longer than the interval: none finishes, the count does not move, but 12 stay in flight.
    seen, decision = run_timed(POLICY, 1, [(0, 0, 0), (3, 12, 0), (6, 12, 0)])
    assert seen == [1, 1, 3]
    assert "3.0 in flight per replica" not in decision.message and decision.message.startswith("1 -> 3")


def test_the_average_is_the_request_rate_times_the_time_of_a_request():
    memory = Memory(last_total=100, last_at=10.0, last_snapshot=0.0)
    assert window_in_flight(memory, Observation(13.0, 0.0, 160, 0.25)) == pytest.approx(5.0)
    # A gateway restart resets the count: the snapshots alone, and only a level seen twice.
    assert window_in_flight(memory, Observation(13.0, 9.0, 3, 0.25)) == 0.0
    # No previous observation: the snapshot.
    assert window_in_flight(Memory(), Observation(13.0, 9.0, 3, 0.25)) == 9.0


def run_timed(policy: Policy, current: int, samples: list[tuple[float, float, int]], avg_time_s: float = 0.5):
    seen, decision, memory = [], None, None
    for at, in_flight, total in samples:
        decision = decide(policy, current, Observation(at, in_flight, total, avg_time_s), memory)
        memory, current = decision.memory, decision.replicas
        seen.append(current)
    return seen, decision


def test_requests_served_before_the_sleep_do_not_wake_it():
    """The interval's average counts the requests served just before the sleep: asleep, it is no reason to
    wake (the wake of a sleeping model comes from a request in flight, held at the gateway)."""
    policy = Policy(min_replicas=0, max_replicas=4, idle_period_s=10)
    memory = Memory(last_total=10, last_at=0.0, last_snapshot=0.0, last_traffic_at=0.0)
    # 40 more requests (each 0.5 s on average) were counted over the 5 s since the last observation.
    awake = decide(policy, 1, Observation(5, 0.0, 50, avg_time_s=0.5), memory)
    asleep = decide(policy, 0, Observation(5, 0.0, 50, avg_time_s=0.5), memory)
    assert awake.in_flight == 4.0 and awake.replicas == 1
    assert asleep.in_flight == 0.0 and asleep.replicas == 0
    assert decide(policy, 0, Observation(10, 2.0, 50, avg_time_s=0.5), asleep.memory).replicas == 1
