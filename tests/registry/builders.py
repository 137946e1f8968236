"""Model files and archives for upload tests, built here byte by byte (torch and TensorFlow are not installed)."""

from __future__ import annotations

import io
import pickle
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import convert_model_to_external_data

SEED_CONFIG = """
name: "mlp"
platform: "graph_executor"
max_batch_size: 8
input [ { name: "input" data_type: TYPE_FP32 dims: [4] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [2] } ]
parameters [ { key: "EXECUTOR_TYPE" value: { string_value: "graph" } } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
"""


def onnx_model(width: int = 4, out: int = 2) -> onnx.ModelProto:
    """input [N,width] @ W [width,out] -> output [N,out]."""
    weight = numpy_helper.from_array(np.arange(width * out, dtype=np.float32).reshape(width, out), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "W"], ["output"])],
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", out])],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def onnx_bytes() -> bytes:
    return onnx_model().SerializeToString()


def onnx_with_external_data(directory: Path, location: str = "weights.bin", width: int = 64) -> Path:
    """Save a model whose weight lives in ``location`` (relative to ``directory``); returns the .onnx path."""
    model = onnx_model(width=width, out=32)
    convert_model_to_external_data(
        model, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0
    )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "net.onnx"
    onnx.save_model(model, path)  # writes weights.bin next to it
    if location != "weights.bin":
        for tensor in model.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = location
        path.write_bytes(model.SerializeToString())
    return path


def zip_bytes(files: dict[str, bytes], compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as zf:
        for name, data in files.items():
            zf.writestr(zipfile.ZipInfo(name), data, compress_type=compression)
    return buffer.getvalue()


def tar_gz_bytes(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.GNU_FORMAT) as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                tf.addfile(info)
    return buffer.getvalue()


def tar_file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def tar_special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 1, 3
    return info, None


def zip_symlink(name: str, target: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        info = zipfile.ZipInfo(name)
        info.create_system = 3
        info.external_attr = 0o120777 << 16
        zf.writestr(info, target)
    return buffer.getvalue()


def torchscript_bytes() -> bytes:
    """The layout torch.jit.save writes: <name>/data.pkl, <name>/code/__torch__/..., constants.pkl, version."""
    return zip_bytes(
        {
            "net/data.pkl": pickle.dumps({"not": "loaded"}),
            "net/code/__torch__/net.py": b"class Net(Module):\n  def forward(self, x): return x\n",
            "net/constants.pkl": pickle.dumps(()),
            "net/version": b"3\n",
        },
        zipfile.ZIP_STORED,
    )


def state_dict_zip_bytes() -> bytes:
    """torch.save(model.state_dict()) in the zip format: data.pkl and tensor storages, no code/."""
    return zip_bytes(
        {
            "archive/data.pkl": pickle.dumps({"fc.weight": "storage 0"}),
            "archive/data/0": b"\0" * 64,
            "archive/version": b"3\n",
            "archive/byteorder": b"little",
        },
        zipfile.ZIP_STORED,
    )


def legacy_pickle_bytes() -> bytes:
    return pickle.dumps({"fc.weight": [1.0, 2.0]}, protocol=2)


def graphdef_bytes() -> bytes:
    """A one-node GraphDef: node { name: "x" op: "Placeholder" } serialized by hand."""
    node = b"\x0a\x01x" + b"\x12\x0bPlaceholder"
    return b"\x0a" + bytes([len(node)]) + node + b"\x22\x02\x08\x1b"


def om_bytes(size: int = 4096) -> bytes:
    return b"IMOD" + bytes(range(256)) * ((size - 4) // 256) + b"\0" * ((size - 4) % 256)


def with_files(version):
    """``version`` with a weights file in its servable and its source directory."""
    weights = version.servable_dir() / "1" / "model.onnx"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"weights")
    (version.source_dir()).mkdir(parents=True)
    (version.source_dir() / "model.onnx").write_bytes(b"weights")
    return version


def serve(owner, version, instance):
    """Deploy ``version`` on ``instance`` and mark its placement served: a SERVING deployment."""
    from apps.deployments import services as deployments
    from apps.deployments.models import Deployment, PlacementState

    deployment = deployments.deploy_version(
        actor=owner, model=version.model, version=version, instances=[instance]
    )
    deployment.placements.update(state=PlacementState.READY, served_version=version)
    deployments.placement_finished(deployment.placements.get())
    return Deployment.objects.get(pk=deployment.pk)
