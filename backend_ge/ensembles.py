"""The wiring of an ensemble, checked before Triton sees it.

Triton checks an ensemble only when it loads it, and then names the first problem it meets in its own words.
:func:`check_wiring` checks the whole pipeline against the signatures of the models its steps call and reports
every mistake at once, each naming the step and the tensor: a step input nothing feeds, a dtype or shape that
does not fit, an ensemble output nobody produces, a cycle, a step whose outputs nobody uses, a step count over
the bound, an ensemble batch size above a step's.

Shapes follow the config's convention: with ``max_batch_size > 0`` the dims exclude the batch dimension; a
batched step inside an unbatched ensemble sees its free batch dimension as a leading ``-1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2 as mc

from backend_ge import dtypes
from backend_ge.config import FieldError, ModelConfig, ModelSignature
from backend_ge.served_config import MAX_ENSEMBLE_STEPS


@dataclass(frozen=True)
class StepModel:
    """What a step calls: the model (its tenant-facing label), the pinned version and its interface."""

    label: str  # "resnet50 v1", used in messages
    signature: ModelSignature
    max_batch_size: int


@dataclass(frozen=True)
class _Tensor:
    dtype: str
    dims: tuple[int, ...]
    source: str  # "ensemble input" or "step[0] (preprocess v1) output 'output'"


def _shape(dims: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def dims_compatible(a: Sequence[int], b: Sequence[int]) -> bool:
    """Same rank, and every dimension equal or dynamic (-1) on one side."""
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b, strict=True))


def _wire(data_type: int) -> str:
    return dtypes.from_config(mc.DataType.Name(data_type)).wire_name


def _step_dims(step: StepModel, dims: Sequence[int], ensemble_batched: bool) -> tuple[int, ...]:
    if step.signature.batched and not ensemble_batched:
        return (-1, *dims)
    return tuple(dims)


def _where(i: int, step: StepModel) -> str:
    return f"step[{i}] ({step.label})"


def check_wiring(cfg: ModelConfig, steps: Sequence[StepModel]) -> list[FieldError]:
    """Every wiring mistake of the ensemble ``cfg``; ``steps[i]`` is what ``cfg``'s step ``i`` calls."""
    errors: list[FieldError] = []
    config_steps = list(cfg.ensemble_scheduling.step)
    base = "ensemble_scheduling.step"
    if not config_steps:
        return [FieldError(base, "an ensemble needs at least one step")]
    if len(config_steps) > MAX_ENSEMBLE_STEPS:
        return [FieldError(base, f"{len(config_steps)} steps; at most {MAX_ENSEMBLE_STEPS}")]
    batched = cfg.max_batch_size > 0
    for i, step in enumerate(steps):
        if batched and (not step.signature.batched or step.max_batch_size < cfg.max_batch_size):
            errors.append(
                FieldError(
                    f"{base}[{i}].model_name",
                    f"{_where(i, step)} takes batches of at most {step.max_batch_size}; the ensemble's "
                    f"max_batch_size {cfg.max_batch_size} is above it (lower it to {step.max_batch_size})",
                )
            )
    available: dict[str, _Tensor] = {
        t.name: _Tensor(_wire(t.data_type), tuple(t.dims), "ensemble input") for t in cfg.input
    }
    consumed: set[str] = set()
    producers: dict[str, int] = {}
    for i, (spec, step) in enumerate(zip(config_steps, steps, strict=True)):
        outputs = {t.name for t in step.signature.outputs}
        for key, tensor in spec.output_map.items():
            where = f"{base}[{i}].output_map.{key}"
            if key not in outputs:
                errors.append(
                    FieldError(
                        where, f"{_where(i, step)} has no output {key!r}; its outputs: {sorted(outputs)}"
                    )
                )
            elif tensor in available:
                errors.append(
                    FieldError(where, f"tensor {tensor!r} is already the {available[tensor].source}")
                )
            elif tensor in producers:
                errors.append(
                    FieldError(where, f"tensor {tensor!r} is already produced by step[{producers[tensor]}]")
                )
            else:
                producers[tensor] = i
    # Steps run when their inputs are there: resolve them in dependency order, so an order mistake, a cycle
    # and a tensor nobody produces are told apart.
    pending = list(range(len(config_steps)))
    produced_tensors: dict[str, _Tensor] = {}
    while pending:
        ready = [
            i
            for i in pending
            if all(t in available or t in produced_tensors for t in config_steps[i].input_map.values())
        ]
        if not ready:
            break
        for i in ready:
            pending.remove(i)
            spec, step = config_steps[i], steps[i]
            for key, tensor in spec.output_map.items():
                out = next((t for t in step.signature.outputs if t.name == key), None)
                if out is not None and producers.get(tensor) == i:
                    produced_tensors[tensor] = _Tensor(
                        out.dtype,
                        _step_dims(step, out.dims, batched),
                        f"output {key!r} of {_where(i, step)}",
                    )
    for i, (spec, step) in enumerate(zip(config_steps, steps, strict=True)):
        inputs = {t.name: t for t in step.signature.inputs}
        for key in sorted(set(inputs) - set(spec.input_map)):
            errors.append(
                FieldError(f"{base}[{i}].input_map", f"{_where(i, step)} input {key!r} is fed by no tensor")
            )
        for key, tensor in spec.input_map.items():
            where = f"{base}[{i}].input_map.{key}"
            consumed.add(tensor)
            if key not in inputs:
                errors.append(
                    FieldError(where, f"{_where(i, step)} has no input {key!r}; its inputs: {sorted(inputs)}")
                )
                continue
            fed = available.get(tensor) or produced_tensors.get(tensor)
            if fed is None:
                if tensor in producers:
                    errors.append(
                        FieldError(
                            where,
                            f"{_where(i, step)} input {key!r} waits for {tensor!r} from step[{producers[tensor]}], "
                            "which waits for this step: a cycle",
                        )
                    )
                else:
                    errors.append(
                        FieldError(
                            where,
                            f"{_where(i, step)} input {key!r} is fed {tensor!r}, which is neither an ensemble "
                            "input nor a step's output",
                        )
                    )
                continue
            want = inputs[key]
            want_dims = _step_dims(step, want.dims, batched)
            if fed.dtype != want.dtype:
                errors.append(
                    FieldError(
                        where,
                        f"{_where(i, step)} input {key!r} is {want.dtype}; {tensor!r} ({fed.source}) is {fed.dtype}",
                    )
                )
            elif not dims_compatible(fed.dims, want_dims):
                errors.append(
                    FieldError(
                        where,
                        f"{_where(i, step)} input {key!r} has shape {_shape(want_dims)}; {tensor!r} "
                        f"({fed.source}) has shape {_shape(fed.dims)}",
                    )
                )
    for j, out in enumerate(cfg.output):
        where = f"output[{j}]"
        consumed.add(out.name)
        made = produced_tensors.get(out.name)
        if made is None:
            if out.name not in producers:
                errors.append(FieldError(where, f"ensemble output {out.name!r} is produced by no step"))
            continue
        dtype, dims = _wire(out.data_type), tuple(out.dims)
        if made.dtype != dtype:
            errors.append(
                FieldError(where, f"ensemble output {out.name!r} is {dtype}; {made.source} is {made.dtype}")
            )
        elif not dims_compatible(made.dims, dims):
            errors.append(
                FieldError(
                    where,
                    f"ensemble output {out.name!r} has shape {_shape(dims)}; {made.source} has shape "
                    f"{_shape(made.dims)}",
                )
            )
    for i, (spec, step) in enumerate(zip(config_steps, steps, strict=True)):
        if not any(t in consumed for t in spec.output_map.values()):
            errors.append(
                FieldError(
                    f"{base}[{i}].output_map",
                    f"{_where(i, step)} is unused: none of its outputs feeds a step or an ensemble output",
                )
            )
    for j, t in enumerate(cfg.input):
        if t.name not in consumed:
            errors.append(FieldError(f"input[{j}]", f"ensemble input {t.name!r} feeds no step"))
    return errors


__all__ = ["MAX_ENSEMBLE_STEPS", "StepModel", "check_wiring", "dims_compatible"]
