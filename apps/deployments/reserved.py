"""Each instance's reserved memory: what its live placements hold, kept in ``TritonInstance.reserved_mb`` so
that a placement decision reads one column per instance instead of summing its pool's placements.

The definition is one SQL aggregate (``used_mb_sql``): per live placement (not unloaded, of a deployment not
undeployed; a retiring one holds its memory until unloaded) its deployment's served version, plus the target
during a switch (both are loaded), each version's measured footprint or else its estimate; and per running tuning job the memory its
scratch replica reserved (``apps.deployments.tuning_jobs``). The writers of
placements (``apps.deployments.scheduler`` and ``services``) keep the column inside the transaction of each
change: ``refresh_reserved`` recomputes it for the instances touched, a decision adds what its new replicas
hold (``scheduler.place_replicas``). ``reserved_drift`` compares the two; the beat repairs any drift
(``repair_reserved``, from ``apps.deployments.healing``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable

from django.db import transaction
from django.db.models import Case, F, IntegerField, OuterRef, Q, Subquery, Sum, Value, When
from django.db.models.functions import Cast, Ceil, Coalesce

from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.deployments.tuning_models import TuningJob, TuningState
from apps.fleet.models import Pool, TritonInstance
from apps.registry.models import FOOTPRINT_BASE_MB, FOOTPRINT_MARGIN, ModelVersion

log = logging.getLogger(__name__)
DRIFT_LOGGED = 10  # instances named in the warning: (kept, summed) each


def _footprint_sql(version: str):
    """``ModelVersion.footprint_estimate_mb`` of the version at the path ``version``, in SQL (0 for none)."""
    estimate = Value(FOOTPRINT_BASE_MB) + Cast(
        Ceil(F(f"{version}__size_bytes") * FOOTPRINT_MARGIN / 2**20), IntegerField()
    )
    return Case(
        When(**{f"{version}__footprint_mb__gt": 0}, then=F(f"{version}__footprint_mb")),
        When(**{f"{version}__isnull": False}, then=estimate),
        default=Value(0),
        output_field=IntegerField(),
    )


def _placement_mb_sql(placement: str = ""):
    """What one placement holds, in SQL: its deployment's served version, plus the target during a switch
    (both are loaded). ``placement``: the path to the placement ("" from a placement row itself)."""
    deployment = f"{placement}deployment"
    target = Case(
        When(
            **{f"{deployment}__target_version": F(f"{deployment}__active_version")},
            then=Value(0),
        ),
        default=_footprint_sql(f"{deployment}__target_version"),
        output_field=IntegerField(),
    )
    return _footprint_sql(f"{deployment}__active_version") + target


def _live_sql(placement: str = "") -> Q:
    """A placement that holds memory: not unloaded (retiring ones hold it until unloaded), of a deployment
    not undeployed."""
    return ~Q(**{f"{placement}state": PlacementState.UNLOADED}) & ~Q(
        **{f"{placement}deployment__state": DeploymentState.UNDEPLOYED}
    )


def used_mb_sql(placements: str = "placements"):
    """The memory an instance's live placements hold, as one SQL aggregate over the relation ``placements``
    of the rows annotated - the definition of ``TritonInstance.reserved_mb``, which the decisions read
    instead (``refresh_reserved`` keeps it; ``reserved_drift`` compares the two)."""
    live = Q(**{f"{placements}__isnull": False}) & _live_sql(f"{placements}__")
    held = Coalesce(
        Sum(_placement_mb_sql(f"{placements}__"), filter=live), Value(0), output_field=IntegerField()
    )
    return held + _tuning_mb_sql()


def _tuning_mb_sql():
    """What the running tuning jobs' scratch replicas on the annotated instance reserved (a subquery: a
    second join beside the placements' would multiply their sum)."""
    rows = (
        TuningJob.objects.filter(instance=OuterRef("pk"), state=TuningState.RUNNING)
        .order_by()
        .values("instance")
        .annotate(mb=Sum("reserved_mb"))
        .values("mb")
    )
    return Coalesce(Subquery(rows, output_field=IntegerField()), Value(0), output_field=IntegerField())


def tuning_held(instance_ids: list[int]) -> dict[int, int]:
    """{instance: MiB} the running tuning jobs on these instances reserved."""
    rows = (
        TuningJob.objects.filter(instance_id__in=instance_ids, state=TuningState.RUNNING)
        .order_by()
        .values("instance_id")
        .annotate(mb=Sum("reserved_mb"))
    )
    return {row["instance_id"]: row["mb"] or 0 for row in rows}


def used_by_instance(instance_ids: list[int] | None = None, *, pool: Pool | None = None) -> dict[int, int]:
    """Memory the live placements on these instances (or the pool's) hold, summed now (``used_mb_sql``)."""
    where = Q(host__pool=pool) if pool is not None else Q(pk__in=instance_ids or [])
    rows = TritonInstance.objects.filter(where).annotate(used=used_mb_sql()).values_list("pk", "used")
    return {pk: used for pk, used in rows if used}


def refresh_reserved(instance_ids: Iterable[int]) -> None:
    """Set these instances' ``reserved_mb`` to what their live placements hold. Called by every change of a
    placement's liveness or of what it holds (created, revived, unloaded, its deployment's versions switched,
    a footprint measured), inside that change's transaction and after it.

    The instances' rows are locked first (in id order; NO KEY UPDATE, so a placement row's foreign key check
    is not blocked), and only then are their placements read, in a statement of its own: under READ COMMITTED
    that statement sees every change committed by a transaction that refreshed these rows before us, and one
    that refreshes them after us waits for our commit - a recomputation, not an increment, so no change is
    counted twice or lost. Decisions hold their pool's lock besides (``candidates_in``): two never read the
    same figure. (A decision adds what its new placements hold instead: ``place_replicas``.) Summed here with ``ModelVersion.footprint_estimate_mb`` from plain columns (a decision pays
    for this, and compiling ``used_mb_sql`` costs more than running it); ``reserved_drift`` checks the two
    agree."""
    ids = sorted({pk for pk in instance_ids if pk})
    if not ids:
        return
    locked = TritonInstance.objects.select_for_update(no_key=True).filter(pk__in=ids).order_by("pk")
    list(locked.values_list("pk", flat=True))
    rows = (
        DeploymentInstance.objects.filter(instance_id__in=ids)
        .exclude(state=PlacementState.UNLOADED)
        .exclude(deployment__state=DeploymentState.UNDEPLOYED)
        .order_by()  # the model's ordering would join the hosts for nothing
        .values_list(
            "instance_id",
            "deployment__active_version_id",
            "deployment__active_version__footprint_mb",
            "deployment__active_version__size_bytes",
            "deployment__target_version_id",
            "deployment__target_version__footprint_mb",
            "deployment__target_version__size_bytes",
        )
    )
    held = dict.fromkeys(ids, 0)
    held.update(tuning_held(ids))
    for instance_id, active, a_mb, a_size, target, t_mb, t_size in rows:
        if active is not None:
            held[instance_id] += ModelVersion(footprint_mb=a_mb, size_bytes=a_size).footprint_estimate_mb()
        if target is not None and target != active:
            held[instance_id] += ModelVersion(footprint_mb=t_mb, size_bytes=t_size).footprint_estimate_mb()
    by_figure: dict[int, list[int]] = defaultdict(list)
    for instance_id, mb in held.items():
        by_figure[mb].append(instance_id)
    for mb, pks in by_figure.items():
        TritonInstance.objects.filter(pk__in=pks).update(reserved_mb=mb)


def refresh_reserved_of(deployment_ids: Iterable[int]) -> None:
    """``refresh_reserved`` for the instances of these deployments' placements (what each holds changed:
    a switch began or ended, a footprint was measured)."""
    rows = DeploymentInstance.objects.filter(deployment_id__in=list(deployment_ids))
    refresh_reserved(rows.values_list("instance_id", flat=True))


def footprint_changed(version_id: int) -> None:
    """A version's footprint was measured (it replaces the estimate): the instances holding it follow."""
    using = Deployment.objects.filter(Q(active_version_id=version_id) | Q(target_version_id=version_id))
    refresh_reserved_of(using.values_list("pk", flat=True))


def reserved_drift(instance_ids: Iterable[int] | None = None) -> dict[int, tuple[int, int]]:
    """Instances whose ``reserved_mb`` differs from the sum over their live placements: {id: (kept, sum)}.
    Empty when every writer kept it (the tests check it after each kind of change; the beat repairs any)."""
    rows = (
        TritonInstance.objects.all()
        if instance_ids is None
        else TritonInstance.objects.filter(pk__in=list(instance_ids))
    )
    rows = rows.annotate(used=used_mb_sql()).values_list("pk", "reserved_mb", "used")
    return {pk: (kept, used) for pk, kept, used in rows if kept != used}


def repair_reserved() -> int:
    """The beat's check: recompute the figure where it drifted (a writer that forgot it). Returns how many
    instances were repaired (0 expected, logged otherwise)."""
    drift = reserved_drift()
    if drift:
        shown = dict(sorted(drift.items())[:DRIFT_LOGGED])
        log.warning("reserved_mb drifted on %d instance(s), recomputed: %s", len(drift), shown)
        with transaction.atomic():  # the beat runs outside a transaction; the rows' lock needs one
            refresh_reserved(drift)
    return len(drift)
