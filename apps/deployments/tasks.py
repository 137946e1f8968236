"""Beat tasks of deployments (they run on the platform's workers, never on a host)."""

from celery import shared_task

from apps.deployments import rollouts


@shared_task(name="apps.deployments.tasks.check_rollouts", ignore_result=True)
def check_rollouts() -> dict[str, int]:
    """Advance live rollouts: begin, check, step, promote or roll back; unload ended canaries. Each check
    claims its rollout, so overlapping ticks (or two beats) never check one twice."""
    return rollouts.check_rollouts()
