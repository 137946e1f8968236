"""Ensembles: a pipeline of a team's own models that Triton runs inside one server.

An ensemble is a RegisteredModel of kind ``ensemble``; each version is either uploaded (a Triton ensemble
directory: ``config.pbtxt`` with ``platform: "ensemble"`` and an empty version folder) or composed through
the API. Either way the tenant's steps name the team's models by slug (``resnet50``; the team's own Triton
name ``team__resnet50`` is accepted too) and a version number, or ``-1``/none for "the version serving" (the
version the step's live deployment serves; the latest READY one when it is not deployed). The platform then

1. resolves each step to a READY version of one of the team's models (another team's model is unknown),
2. checks the wiring against those versions' signatures (``backend_ge.ensembles.check_wiring``),
3. writes the served config with the Triton names (``team__model``) and the pinned version numbers, rebuilt
   from the allow-list (``backend_ge.served_config``) with exactly those models allowed as steps,
4. records the pinned steps (``EnsembleStep``) so deploys, switches and deletes know who depends on whom.

Every mistake is a ValidationError whose keys are config field paths and whose messages name the step and
the tensor.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass

from django.core.exceptions import ValidationError
from django.db import transaction

from apps.audit.services import record
from apps.registry.models import (
    EnsembleStep,
    ModelKind,
    ModelVersion,
    RegisteredModel,
    SourceFormat,
    VersionState,
)
from apps.registry.signals import serving_version
from backend_ge import config as gc
from backend_ge import dtypes, naming
from backend_ge.ensembles import StepModel, check_wiring
from backend_ge.served_config import build_served_config

SERVING = -1  # a step's version: the one its deployment serves


@dataclass
class PreparedEnsemble:
    """A checked ensemble: the served config (Triton names, pinned versions) and the versions it calls."""

    config: gc.ModelConfig
    steps: list[ModelVersion]


def _errors(errors) -> ValidationError:
    return ValidationError(gc.ConfigError(errors).as_dict())


def _team_model(team, name: str) -> RegisteredModel | None:
    """The team's model a step names (its slug, or the team's own Triton name); another team's is unknown."""
    slug = name
    if naming.is_triton_model_name(name):
        team_slug, slug = naming.parse_triton_model_name(name)
        if team_slug != team.slug:
            return None
    if not naming.is_slug(slug):
        return None
    return RegisteredModel.objects.filter(team=team, slug=slug).first()


def _step_version(model: RegisteredModel, number: int) -> ModelVersion | None:
    if number in (SERVING, 0):
        for _, answer in serving_version.send(RegisteredModel, model=model):
            if answer is not None and answer.is_servable():
                return answer
        return model.latest_version()
    return model.versions.ready().filter(number=number).first()


def _max_batch_size(version: ModelVersion) -> int:
    try:
        return gc.parse_config(version.config_text).max_batch_size
    except gc.ConfigError:
        return 0


def resolve_steps(team, cfg: gc.ModelConfig) -> list[ModelVersion]:
    """The READY version each step calls; ValidationError naming every step that names none."""
    errors, found = [], []
    for i, step in enumerate(cfg.ensemble_scheduling.step):
        where = f"ensemble_scheduling.step[{i}].model_name"
        model = _team_model(team, step.model_name)
        if model is None:
            errors.append(
                gc.FieldError(where, f"step[{i}]: {step.model_name[:60]!r} is not a model of this team")
            )
            continue
        if model.is_ensemble():
            errors.append(gc.FieldError(where, f"step[{i}]: {model.slug} is an ensemble; steps call models"))
            continue
        version = _step_version(model, step.model_version)
        if version is None:
            which = (
                "no READY version"
                if step.model_version in (SERVING, 0)
                else f"no READY version {step.model_version}"
            )
            errors.append(gc.FieldError(where, f"step[{i}]: {model.slug} has {which}"))
            continue
        found.append(version)
    if errors:
        raise _errors(errors)
    return found


def _any_step_name(name: str) -> bool:
    return naming.is_slug(name) or naming.is_triton_model_name(name)


def prepare_ensemble(model: RegisteredModel, config: gc.ModelConfig | str) -> PreparedEnsemble:
    """Check an ensemble config (a tenant's: steps by slug) for ``model`` and build what is served."""
    if not model.is_ensemble():
        raise ValidationError(
            {"kind": [f"{model.slug} is a model, not an ensemble: create a model of kind 'ensemble' for it."]}
        )
    name = model.triton_model_name()
    try:
        cfg = build_served_config(config, name=name, allowed_models=_any_step_name)
    except gc.ConfigError as exc:
        raise ValidationError(exc.as_dict()) from None
    if cfg.platform != gc.ENSEMBLE_PLATFORM:
        raise ValidationError({"platform": ['An ensemble\'s config has platform: "ensemble".']})
    versions = resolve_steps(model.team, cfg)
    steps = [
        StepModel(str(v), gc.ModelSignature.from_dict(v.signature), _max_batch_size(v)) for v in versions
    ]
    wiring = check_wiring(cfg, steps)
    if wiring:
        raise _errors(wiring)
    for step, version in zip(cfg.ensemble_scheduling.step, versions, strict=True):
        step.model_name = version.model.triton_model_name()
        step.model_version = version.number
    try:  # defence in depth: exactly the resolved models may be called
        served = build_served_config(
            cfg, name=name, allowed_models={v.model.triton_model_name() for v in versions}
        )
    except gc.ConfigError as exc:
        raise ValidationError(exc.as_dict()) from None
    return PreparedEnsemble(served, versions)


def _write_servable(version: ModelVersion, rendered: str) -> None:
    """config.pbtxt and an empty ``1/``, as Triton lays out an ensemble, renamed into place whole."""
    target = version.servable_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-model-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    (tmp / "1").mkdir()
    (tmp / "config.pbtxt").write_text(rendered, encoding="utf-8")
    if target.exists():
        shutil.rmtree(target)
    os.rename(tmp, target)


def store_ensemble(*, actor, version: ModelVersion, prepared: PreparedEnsemble, action: str) -> ModelVersion:
    """Make ``version`` the READY ensemble ``prepared`` describes (call inside a transaction)."""
    rendered = gc.render_config(prepared.config)
    version.state = VersionState.READY
    version.source_format = SourceFormat.ENSEMBLE
    version.config_text = rendered
    version.signature = gc.signature_from_config(prepared.config).to_dict()
    version.toolchain = ""
    version.error = ""
    version.save()
    version.ensemble_steps.all().delete()
    EnsembleStep.objects.bulk_create(
        EnsembleStep(ensemble_version=version, position=i, step_version=step)
        for i, step in enumerate(prepared.steps)
    )
    _write_servable(version, rendered)
    record(
        actor=actor,
        team=version.model.team,
        action=action,
        target=version,
        details={
            "model": version.model.slug,
            "version": version.number,
            "steps": [f"{s.model.slug} v{s.number}" for s in prepared.steps],
        },
    )
    return version


# --- composing ------------------------------------------------------------------------------------


def _tensor(items, kind: str, errors: list) -> list[dict]:
    if not isinstance(items, list) or not items:
        errors.append(gc.FieldError(kind, f"give the ensemble's {kind}s as a list of tensors"))
        return []
    out = []
    for j, item in enumerate(items):
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            errors.append(gc.FieldError(f"{kind}[{j}]", "a tensor is a name or {name, data_type, dims}"))
            continue
        out.append(item)
    return out


def _fill_from_steps(cfg: gc.ModelConfig, versions: list[ModelVersion], tensor, kind: str) -> bool:
    """Take an ensemble tensor's dtype and dims from the step tensor it is wired to."""
    batched = cfg.max_batch_size > 0
    for step, version in zip(cfg.ensemble_scheduling.step, versions, strict=True):
        signature = gc.ModelSignature.from_dict(version.signature)
        mapping = step.input_map if kind == "input" else step.output_map
        for key, name in mapping.items():
            if name != tensor.name:
                continue
            side = signature.inputs if kind == "input" else signature.outputs
            found = next((t for t in side if t.name == key), None)
            if found is None:
                return False
            tensor.data_type = gc.mc.DataType.Value(dtypes.from_wire(found.dtype).config_name)
            dims = list(found.dims)
            tensor.dims.extend(dims if batched or not signature.batched else [-1, *dims])
            return True
    return False


def config_from_spec(model: RegisteredModel, spec: dict) -> gc.ModelConfig:
    """A tenant's ensemble config from the compose API's body: ``steps`` (``model`` slug, ``version`` or
    null for the version serving, ``input_map``, ``output_map``), ``inputs``/``outputs`` (names, with
    ``data_type``/``dims`` optional: taken from the step tensor they are wired to), ``max_batch_size``."""
    errors: list[gc.FieldError] = []
    cfg = gc.ModelConfig(name=model.triton_model_name(), platform=gc.ENSEMBLE_PLATFORM)
    mbs = spec.get("max_batch_size", 0)
    if not isinstance(mbs, int) or isinstance(mbs, bool):
        errors.append(gc.FieldError("max_batch_size", "a whole number"))
    else:
        cfg.max_batch_size = mbs
    steps = spec.get("steps")
    if not isinstance(steps, list) or not steps:
        errors.append(gc.FieldError("ensemble_scheduling.step", "give the steps as a list"))
        steps = []
    for i, item in enumerate(steps):
        where = f"ensemble_scheduling.step[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("model"), str):
            errors.append(gc.FieldError(where, "a step is {model, version, input_map, output_map}"))
            continue
        version = item.get("version")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 1):
            errors.append(
                gc.FieldError(f"{where}.model_version", "a version number, or null for the version serving")
            )
            version = None
        step = cfg.ensemble_scheduling.step.add(model_name=item["model"], model_version=version or SERVING)
        for kind in ("input_map", "output_map"):
            mapping = item.get(kind) or {}
            if not isinstance(mapping, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
            ):
                errors.append(
                    gc.FieldError(f"{where}.{kind}", "a map of step tensor -> ensemble tensor names")
                )
                continue
            getattr(step, kind).update(mapping)
    wanted = {kind: _tensor(spec.get(f"{kind}s"), kind, errors) for kind in ("input", "output")}
    if errors:
        raise _errors(errors)
    versions = resolve_steps(model.team, cfg)
    for kind, items in wanted.items():
        for j, item in enumerate(items):
            tensor = getattr(cfg, kind).add(name=item["name"])
            if item.get("data_type") is not None or item.get("dims") is not None:
                try:
                    tensor.data_type = gc.mc.DataType.Value(
                        dtypes.from_config(str(item.get("data_type"))).config_name
                    )
                    tensor.dims.extend(int(d) for d in item.get("dims") or [])
                except (ValueError, TypeError, KeyError) as exc:
                    errors.append(gc.FieldError(f"{kind}[{j}]", f"data_type and dims: {exc}"))
            elif not _fill_from_steps(cfg, versions, tensor, kind):
                errors.append(
                    gc.FieldError(
                        f"{kind}[{j}]", f"ensemble {kind} {item['name']!r} is wired to no step {kind}"
                    )
                )
    if errors:
        raise _errors(errors)
    return cfg


def compose_ensemble(*, actor, model: RegisteredModel, spec: dict, note: str = "") -> ModelVersion:
    """A new READY version of the ensemble ``model`` from the compose API's body (see config_from_spec)."""
    if not model.is_ensemble():
        raise ValidationError(
            {"kind": [f"{model.slug} is a model, not an ensemble: create a model of kind 'ensemble' for it."]}
        )
    prepared = prepare_ensemble(model, config_from_spec(model, spec))
    return _new_version(actor=actor, model=model, prepared=prepared, note=note, action="ensemble.composed")


def _new_version(*, actor, model: RegisteredModel, prepared: PreparedEnsemble, note: str, action: str):
    with transaction.atomic():
        locked = RegisteredModel.objects.select_for_update().select_related("team").get(pk=model.pk)
        if not locked.is_ensemble():  # its first upload, a model file, made it a model meanwhile
            raise ValidationError(
                {"kind": [f"{model.slug} is of kind '{locked.kind}' now, not an ensemble."]}
            )
        number = locked.next_version_number()
        version = locked.versions.create(
            number=number,
            state=VersionState.UPLOADED,
            source_format=SourceFormat.ENSEMBLE,
            note=(note or "")[:2000],
            created_by=actor if getattr(actor, "is_authenticated", False) else None,
        )
        try:
            store_ensemble(actor=actor, version=version, prepared=prepared, action=action)
        except BaseException:
            shutil.rmtree(version.storage_dir(), ignore_errors=True)
            raise
    return version


def update_step(
    *, actor, version: ModelVersion, step: str | int, step_version: int, note: str = ""
) -> ModelVersion:
    """A new version of ``version``'s ensemble with the same wiring, one step pinned to another version of
    its model: ``step`` is the step's position or its model's slug (the first step calling it). The wiring
    is checked again against that version's signature, as any new ensemble version."""
    model = version.model
    if not model.is_ensemble() or version.source_format != SourceFormat.ENSEMBLE:
        raise ValidationError({"version": [f"{version} is not an ensemble version."]})
    try:
        cfg = gc.parse_config(version.config_text)
    except gc.ConfigError as exc:
        raise ValidationError(exc.as_dict()) from None
    steps = list(version.ensemble_steps.select_related("step_version__model").order_by("position"))
    if isinstance(step, int) and not isinstance(step, bool):
        found = next((s for s in steps if s.position == step), None)
    else:
        found = next((s for s in steps if s.step_version.model.slug == step), None)
    if found is None:
        names = ", ".join(f"{s.position} ({s.step_version.model.slug})" for s in steps)
        raise ValidationError({"step": [f"{version} has no step {str(step)[:60]!r}; its steps: {names}."]})
    current = found.step_version
    if current.number == step_version:
        raise ValidationError(
            {"version": [f"step[{found.position}] already calls {current}; pick another version."]}
        )
    cfg.ensemble_scheduling.step[found.position].model_version = step_version
    prepared = prepare_ensemble(model, cfg)
    text = (
        note
        or f"v{version.number} with step[{found.position}] {current.model.slug} v{current.number} -> v{step_version}"
    )
    return _new_version(
        actor=actor, model=model, prepared=prepared, note=text, action="ensemble.step_updated"
    )


def kind_of_format(fmt: str) -> str:
    """The kind a version of format ``fmt`` belongs to."""
    return ModelKind.ENSEMBLE if fmt == SourceFormat.ENSEMBLE else ModelKind.MODEL


def upload_kind(model: RegisteredModel, fmt: str, version: ModelVersion) -> str:
    """The kind ``model`` has once ``version`` (format ``fmt``) is in: its own, or - for a model whose other
    versions hold nothing yet - the upload's (an ensemble archive makes it an ensemble, a model file a model).
    ValidationError when the model already holds versions of the other kind: the message names the model
    and its kind. The caller holding the model row's lock makes the answer final."""
    kind = kind_of_format(fmt)
    if kind == model.kind or not model.has_versions_besides(version):
        return kind
    if kind == ModelKind.ENSEMBLE:
        message = (
            f"this is a Triton ensemble, but {model.slug} is of kind '{model.kind}' and has versions: create a "
            "model of kind 'ensemble' and upload it there"
        )
    else:
        message = (
            f"this is a model file, but {model.slug} is of kind '{model.kind}' and has versions: upload a "
            "Triton ensemble directory or compose a version, or upload the file to a model of kind 'model'"
        )
    raise ValidationError({"file": [message]})


def pipeline(version: ModelVersion) -> list[dict]:
    """The steps and their wiring, for pages and the API."""
    try:
        cfg = gc.parse_config(version.config_text)
    except gc.ConfigError:
        return []
    pinned = {
        s.position: s.step_version for s in version.ensemble_steps.select_related("step_version__model")
    }
    out = []
    for i, step in enumerate(cfg.ensemble_scheduling.step):
        called = pinned.get(i)
        out.append(
            {
                "position": i,
                "model": called.model.slug if called else step.model_name,
                "version": called.number if called else step.model_version,
                "triton_name": step.model_name,
                "input_map": dict(step.input_map),
                "output_map": dict(step.output_map),
            }
        )
    return out
