"""Tasks on a host's own queue (``host.<name>``): they run inside that host's agent."""

from celery import shared_task

from apps.fleet.agent import current_agent


@shared_task(name="apps.fleet.tasks.reconcile_host")
def reconcile_host() -> None:
    current_agent().poke()


@shared_task(name="apps.fleet.tasks.restart_instance")
def restart_instance(instance_id: int) -> None:
    agent = current_agent()
    proc = agent.processes.get(instance_id)
    if proc is not None:
        with proc.lock:
            if proc.server is not None:
                proc.server.stop()
                proc.server = None
            proc.next_start_at = 0.0
    agent.poke()


@shared_task(name="apps.fleet.tasks.apply_placement")
def apply_placement(placement_id: int, generation: int | None = None) -> None:
    """Make one instance serve its deployment's target version (load, smoke test, switch) or undeploy it.
    ``generation`` is the decision it was sent for: a task for an older decision does nothing."""
    from apps.fleet.placement import apply_placement as apply

    apply(placement_id, generation)
