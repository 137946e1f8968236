"""The seed's ensemble steps as real converted versions, and inference through the gateway, for the live
ensemble tests."""

from __future__ import annotations

import json

import numpy as np
import onnx

from apps.registry import services as registry
from apps.registry.models import ModelVersion, RegisteredModel, SourceFormat, VersionState
from backend_ge import examples
from backend_ge.convert import prepare_onnx

BUILDERS = {
    "preprocess": examples.build_preprocess,
    "resnet50": examples.build_resnet50,
    "postprocess": examples.build_postprocess,
}


def converted_step(owner, team, slug: str, scratch, number: int = 1) -> ModelVersion:
    """The seed's step as a READY version through the real ONNX preparation, batching up to 32 as the seed
    (version ``number``: the model is created for the first one)."""
    model = (
        registry.create_model(actor=owner, team=team, name=slug, slug=slug)
        if number == 1
        else RegisteredModel.objects.get(team=team, slug=slug)
    )
    version = ModelVersion.objects.create(
        model=model,
        number=number,
        state=VersionState.CONVERTING,
        source_format=SourceFormat.ONNX,
        created_by=owner,
    )
    source = scratch / f"{slug}-{number}.onnx"
    onnx.save_model(BUILDERS[slug](), source)
    version.servable_dir().parent.mkdir(parents=True, exist_ok=True)
    prepared = prepare_onnx(
        source, version.servable_dir() / "1", name=model.triton_model_name(), max_batch_size=32
    )
    version.signature = prepared.signature.to_dict()
    version.config_text = (version.servable_dir() / "config.pbtxt").read_text()
    version.state = VersionState.READY
    version.save()
    return version


def infer(gateway, model: str, token: str, name: str, array: np.ndarray, datatype: str) -> dict:
    body = {
        "inputs": [
            {"name": name, "shape": list(array.shape), "datatype": datatype, "data": array.ravel().tolist()}
        ]
    }
    status, answer = gateway.request("POST", f"/v2/models/{model}/infer", token, json.dumps(body).encode())
    assert status == 200, (status, answer)
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in answer["outputs"]}
