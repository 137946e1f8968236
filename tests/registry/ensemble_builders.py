"""The seed's ensemble pieces as registry rows (fast: signatures and configs, no model files) and the seed's
ensemble directory as an upload."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from apps.registry import services
from apps.registry.models import ModelKind, ModelVersion, SourceFormat, VersionState
from backend_ge import config as gc
from backend_ge import examples

SIGNATURES = {
    "preprocess": ((("input", "UINT8", (224, 224, 3)),), (("output", "FP32", (3, 224, 224)),)),
    "resnet50": ((("input", "FP32", (3, 224, 224)),), (("output", "FP32", (1000,)),)),
    "postprocess": ((("input", "FP32", (1000,)),), (("output", "INT64", (5,)), ("scores", "FP32", (5,)))),
}


def _signature(name: str) -> gc.ModelSignature:
    inputs, outputs = SIGNATURES[name]
    return gc.ModelSignature(
        tuple(gc.TensorSignature(*t) for t in inputs), tuple(gc.TensorSignature(*t) for t in outputs), True
    )


def ready_step(model, *, max_batch_size: int = 32) -> ModelVersion:
    """The model's next version, READY, with the seed step's signature (no model file: never served)."""
    signature = _signature(model.slug)
    number = (model.versions.order_by("-number").values_list("number", flat=True).first() or 0) + 1
    cfg = gc.generate_config(model.triton_model_name(), signature, max_batch_size=max_batch_size)
    return ModelVersion.objects.create(
        model=model,
        number=number,
        state=VersionState.READY,
        source_format=SourceFormat.ONNX,
        signature=signature.to_dict(),
        config_text=gc.render_config(cfg),
    )


def seed_steps(owner, team, **options) -> dict[str, ModelVersion]:
    out = {}
    for slug in ("preprocess", "resnet50", "postprocess"):
        model = services.create_model(actor=owner, team=team, name=slug, slug=slug)
        out[slug] = ready_step(model, **options)
    return out


def ensemble_model(owner, team, slug="classify"):
    return services.create_model(actor=owner, team=team, name=slug, slug=slug, kind=ModelKind.ENSEMBLE)


def seed_ensemble_dir(root: Path) -> Path:
    """The seed's ensemble directory as ``python -m backend_ge examples`` writes it."""
    examples._write_ensemble(root)
    return root / examples.ENSEMBLE


def tar_of(directory: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(directory, arcname=directory.name)
    return buffer.getvalue()


def seed_spec(**changes) -> dict:
    """The seed's pipeline in the compose API's shape."""
    spec = {
        "max_batch_size": 32,
        "inputs": [{"name": "raw_image"}],
        "outputs": [{"name": "predictions"}, {"name": "scores"}],
        "steps": [
            {"model": "preprocess", "input_map": {"input": "raw_image"}, "output_map": {"output": "pre"}},
            {
                "model": "resnet50",
                "version": 1,
                "input_map": {"input": "pre"},
                "output_map": {"output": "logits"},
            },
            {
                "model": "postprocess",
                "input_map": {"input": "logits"},
                "output_map": {"output": "predictions", "scores": "scores"},
            },
        ],
    }
    spec.update(changes)
    return spec
