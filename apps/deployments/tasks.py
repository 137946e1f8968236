"""Beat tasks of deployments (they run on the platform's workers, never on a host)."""

from celery import shared_task

from apps.deployments import healing, rollouts


@shared_task(name="apps.deployments.tasks.check_rollouts", ignore_result=True)
def check_rollouts() -> dict[str, int]:
    """Advance live rollouts: begin, check, step, promote or roll back; unload ended canaries. Each check
    claims its rollout, so overlapping ticks (or two beats) never check one twice."""
    return rollouts.check_rollouts()


@shared_task(name="apps.deployments.tasks.scheduler_tick", ignore_result=True)
def scheduler_tick() -> dict[str, int]:
    """Replace lost replicas, drain hosts one replica at a time, place pending replicas, unload surplus."""
    return healing.tick()
