"""How to call a deployment: its endpoints (the gateway's), client snippets generated from the signature, and
the playground that runs one inference against a READY placement.

The snippets are the seed's examples filled in for the model (``backend_ge.samples``), so what a user copies
is exactly what the tests run. The playground builds each input from one of three sources - random data of
the right shape and type, JSON values, or an uploaded file (``.npy``; an image for image-shaped inputs when
Pillow is installed) - and summarises each output, with the top-5 classes for a classifier-shaped one.
"""

from __future__ import annotations

import io
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np
from django.conf import settings
from django.core.exceptions import ValidationError

from apps.deployments.models import Deployment, DeploymentInstance, PlacementState
from apps.fleet.models import InstanceState
from apps.registry.models import ModelVersion
from backend_ge import dtypes, samples
from backend_ge.config import ModelSignature, TensorSignature

INPUT_MODES = ("random", "json", "file")
# Outputs up to this many values come back whole; bigger ones as a preview (the UI shows the top-5 anyway).
FULL_OUTPUT_LIMIT = 4096
PREVIEW_VALUES = 32
INFER_TIMEOUT = 60.0


class PlaygroundUnavailable(Exception):
    """The deployment has no READY placement to run on, or the inference failed on the server."""


def shown_version(deployment: Deployment) -> ModelVersion | None:
    """The version the snippets describe: the one serving, else the one being rolled out."""
    return deployment.active_version or deployment.target_version


def ready_placement(deployment: Deployment) -> DeploymentInstance | None:
    """The first placement that serves a version on an instance that is up (a stopped or crashed instance
    keeps its placements until it is READY again, but cannot answer)."""
    return (
        deployment.placements.filter(
            state=PlacementState.READY, served_version__isnull=False, instance__state=InstanceState.READY
        )
        .select_related("instance__host", "served_version")
        .order_by("instance__host__name", "instance__name")
        .first()
    )


def gateway_endpoints(deployment: Deployment) -> dict[str, str]:
    """Where clients call the deployment: the gateway's HTTP and gRPC addresses (GATEWAY_PUBLIC_URL,
    GATEWAY_PUBLIC_GRPC) and the model's KServe v2 inference URL. Clients never call an instance: instances
    answer only the gateway and the platform."""
    url = settings.GATEWAY_PUBLIC_URL.rstrip("/")
    return {
        "http": url,
        "grpc": settings.GATEWAY_PUBLIC_GRPC,
        "infer_url": f"{url}/v2/models/{deployment.triton_model_name()}/infer",
    }


def instance_endpoints(deployment: Deployment) -> list[str]:
    """The HTTP endpoint of every instance the deployment is placed on, READY ones first (for staff: the
    addresses the gateway forwards to)."""
    placements = sorted(
        deployment.placements.all(),  # prefetched with their instances' hosts by the API's queryset
        key=lambda p: (p.state != PlacementState.READY, p.instance.host.name, p.instance.name),
    )
    return [p.instance.endpoint_url() for p in placements]


def snippets(deployment: Deployment) -> dict:
    """Endpoint, Triton model name, a tritonclient script (seed example 3) and a curl command (seed
    example 1, step 5) for the deployment's served version."""
    if not deployment.is_live():
        raise ValidationError(
            {"non_field_errors": ["This deployment was undeployed; there is nothing to call."]}
        )
    version = shown_version(deployment)
    if version is None or not version.signature:
        raise ValidationError(
            {"non_field_errors": ["This deployment has no version with a signature to describe."]}
        )
    if not deployment.placements.exists():
        raise ValidationError({"non_field_errors": ["This deployment is not placed on any instance."]})
    signature = ModelSignature.from_dict(version.signature)
    name = deployment.triton_model_name()
    # Clients call the gateway (token checked, balanced over the placements), never an instance.
    gateway = gateway_endpoints(deployment)
    url = gateway["http"]
    return {
        "endpoint": url,
        "endpoints": [url],
        "grpc_endpoint": gateway["grpc"],
        "token_env": samples.TOKEN_ENV,
        "triton_model_name": name,
        "version": version.number,
        "infer_url": gateway["infer_url"],
        "signature": version.signature,
        "tritonclient": samples.tritonclient_example(url, name, signature, auth=True),
        "tritonclient_grpc": samples.tritonclient_example(
            gateway["grpc"], name, signature, auth=True, grpc=True
        ),
        "curl": samples.curl_example(url, name, signature, auth=True),
    }


# ----------------------------------------------------------------------------------------- playground


@dataclass
class InputSpec:
    """Where one input's values come from."""

    mode: str = "random"
    data: object = None  # JSON values (mode "json")
    upload: object = None  # an uploaded file (mode "file")


@dataclass
class PlaygroundResult:
    instance: str
    endpoint: str
    version: int
    latency_ms: float
    inputs: list[dict] = field(default_factory=list)
    outputs: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "instance": self.instance,
            "endpoint": self.endpoint,
            "version": self.version,
            "latency_ms": round(self.latency_ms, 3),
            "inputs": self.inputs,
            "outputs": self.outputs,
        }


def is_image_shaped(tensor: TensorSignature) -> bool:
    """[C,H,W] or [H,W,C] with 1 or 3 channels: an uploaded picture can fill it."""
    dims = tensor.dims
    return (
        len(dims) == 3
        and (dims[0] in (1, 3) or dims[-1] in (1, 3))
        and tensor.dtype in ("FP32", "FP16", "UINT8")
    )


def _input_error(name: str, message: str) -> ValidationError:
    return ValidationError({f"inputs.{name}": [message]})


def _fit_shape(tensor: TensorSignature, array: np.ndarray, batched: bool) -> np.ndarray:
    """Accept the full request shape, the shape without the batch dimension, or a flat list of the right
    number of values; dynamic dimensions take whatever the data has."""
    want = samples.request_shape(tensor, batched)
    dims = list(tensor.dims)
    full = [-1, *dims] if batched else dims

    def matches(shape, pattern) -> bool:
        return len(shape) == len(pattern) and all(
            p < 0 or s == p for s, p in zip(shape, pattern, strict=True)
        )

    if matches(list(array.shape), full):
        return array
    if batched and matches(list(array.shape), dims):
        return array[np.newaxis, ...]
    if array.ndim == 1 and array.size == int(np.prod(want)):
        return array.reshape(want)
    raise _input_error(
        tensor.name,
        f"'{tensor.name}' needs shape {full} (-1: any size), or {int(np.prod(want))} values as a flat list; "
        f"got shape {list(array.shape)}.",
    )


class ElementBudget:
    """How many input values one playground request may still build (PLAYGROUND_MAX_ELEMENTS in all): a
    model's declared dims, a .npy header and JSON lists are all checked against it before the memory for
    them is taken."""

    def __init__(self, limit: int | None = None):
        self.limit = settings.PLAYGROUND_MAX_ELEMENTS if limit is None else limit
        self.left = self.limit

    def take(self, tensor: TensorSignature, count: int, what: str) -> None:
        if count > self.left:
            raise _input_error(
                tensor.name,
                f"'{tensor.name}': {what} has {count:,} values; the playground takes at most {self.limit:,} "
                "values per request. Call the model through its endpoint (see the snippets) for bigger inputs.",
            )
        self.left -= count


def _from_json(tensor: TensorSignature, data, batched: bool, budget: ElementBudget) -> np.ndarray:
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise _input_error(tensor.name, f"'{tensor.name}': not valid JSON ({exc.msg}).") from None
    dtype = dtypes.from_wire(tensor.dtype).numpy
    try:
        array = np.asarray(data, dtype=dtype)
    except (TypeError, ValueError):
        raise _input_error(
            tensor.name, f"'{tensor.name}': give a (nested) list of {tensor.dtype} numbers."
        ) from None
    if array.dtype == object or array.ndim == 0:
        raise _input_error(tensor.name, f"'{tensor.name}': give a (nested) list of {tensor.dtype} numbers.")
    budget.take(tensor, int(array.size), "the JSON list")
    return _fit_shape(tensor, array, batched)


def _decode_image(tensor: TensorSignature, raw: bytes, budget: ElementBudget) -> np.ndarray:
    try:
        from PIL import Image
    except ImportError:
        raise _input_error(
            tensor.name,
            f"'{tensor.name}': image files need Pillow, which this platform does not have installed; "
            "upload a .npy array instead (numpy.save).",
        ) from None
    channels_first = tensor.dims[0] in (1, 3)
    channels = tensor.dims[0] if channels_first else tensor.dims[-1]
    height, width = (tensor.dims[1], tensor.dims[2]) if channels_first else (tensor.dims[0], tensor.dims[1])
    try:
        image = Image.open(io.BytesIO(raw))
        budget.take(tensor, image.width * image.height * channels, "the image")
        image = image.convert("RGB" if channels == 3 else "L")
    except ValidationError:
        raise
    except Exception:  # Pillow raises many types for a broken file
        raise _input_error(
            tensor.name, f"'{tensor.name}': the file is neither a .npy array nor an image."
        ) from None
    if height > 0 and width > 0:
        image = image.resize((width, height))
    array = np.asarray(image)
    array = array[..., np.newaxis] if array.ndim == 2 else array
    if channels_first:
        array = array.transpose(2, 0, 1)
    if tensor.dtype != "UINT8":
        array = array.astype(np.float32) / 255.0
    return array.astype(dtypes.from_wire(tensor.dtype).numpy)


def _read_npy(tensor: TensorSignature, upload, budget: ElementBudget) -> np.ndarray:
    """The array of a .npy upload. Its header is checked first - a plain numeric dtype, a shape within the
    budget, a file exactly as long as the header says - so an oversized array is refused unread."""
    unreadable = f"'{tensor.name}': unreadable .npy file"
    upload.seek(0)
    try:
        version = np.lib.format.read_magic(upload)
        header = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        shape, _, dtype = header(upload, max_header_size=10_000)
    except (ValueError, SyntaxError, EOFError) as exc:
        raise _input_error(tensor.name, f"{unreadable} ({exc}).") from None
    if dtype.hasobject or dtype.kind not in "biuf":
        raise _input_error(tensor.name, f"'{tensor.name}': the .npy file must hold numbers, not {dtype}.")
    count = math.prod(shape)  # Python ints: a hostile header cannot overflow the check
    budget.take(tensor, count, f"the .npy file (shape {list(shape)})")
    if upload.size != upload.tell() + count * dtype.itemsize:
        raise _input_error(tensor.name, f"{unreadable}: its length does not match its header.")
    upload.seek(0)
    try:
        array = np.load(upload, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise _input_error(tensor.name, f"{unreadable} ({exc}).") from None
    return array.astype(dtypes.from_wire(tensor.dtype).numpy, copy=False)


def _from_file(tensor: TensorSignature, upload, batched: bool, budget: ElementBudget) -> np.ndarray:
    if upload is None:
        raise _input_error(tensor.name, f"'{tensor.name}': choose a file, or another input mode.")
    limit = settings.PLAYGROUND_MAX_BYTES
    if upload.size > limit:  # also checked on the request; a file part is never read past the limit
        raise _input_error(
            tensor.name, f"'{tensor.name}': the file is larger than the playground's {limit / 2**20:g} MiB."
        )
    upload.seek(0)
    magic = upload.read(6)
    if magic == b"\x93NUMPY":
        array = _read_npy(tensor, upload, budget)
    elif is_image_shaped(tensor):
        upload.seek(0)
        array = _decode_image(tensor, upload.read(), budget)
    else:
        raise _input_error(
            tensor.name, f"'{tensor.name}': upload a .npy array (numpy.save) of shape {list(tensor.dims)}."
        )
    return _fit_shape(tensor, array, batched)


def build_inputs(
    signature: ModelSignature, specs: dict[str, InputSpec], seed: int | None = None
) -> dict[str, np.ndarray]:
    """One array per input of the signature; inputs without a spec get random data."""
    unknown = sorted(set(specs) - {t.name for t in signature.inputs})
    if unknown:
        raise ValidationError(
            {"inputs": [f"The model has no input {', '.join(map(repr, unknown))}; its inputs: "
                        f"{', '.join(t.name for t in signature.inputs)}."]}
        )  # fmt: skip
    rng_seed = seed if seed is not None else int(time.time_ns() % (2**32))
    budget = ElementBudget()
    arrays = {}
    for tensor in signature.inputs:
        spec = specs.get(tensor.name, InputSpec())
        if spec.mode not in INPUT_MODES:
            raise _input_error(
                tensor.name, f"'{spec.mode}' is not an input mode; use {', '.join(INPUT_MODES)}."
            )
        if spec.mode == "json":
            arrays[tensor.name] = _from_json(tensor, spec.data, signature.batched, budget)
        elif spec.mode == "file":
            arrays[tensor.name] = _from_file(tensor, spec.upload, signature.batched, budget)
        else:
            # The model's declared dims are a tenant's numbers too: checked before the array is made.
            shape = samples.request_shape(tensor, signature.batched)
            budget.take(tensor, math.prod(shape), f"random data of shape {shape}")
            one = ModelSignature(inputs=(tensor,), outputs=(), batched=signature.batched)
            arrays[tensor.name] = samples.example_inputs(one, seed=rng_seed)[tensor.name]
    return arrays


def summarize_output(name: str, array: np.ndarray) -> dict:
    """Shape, type and values of one output; top-5 (index, score) when it looks like class scores."""
    summary: dict = {
        "name": name,
        "datatype": dtypes.from_numpy(array.dtype).wire_name if array.dtype != object else "BYTES",
        "shape": list(array.shape),
    }
    flat = array.reshape(-1)
    if flat.size <= FULL_OUTPUT_LIMIT:
        summary["data"] = flat.tolist()
    else:
        summary["preview"] = flat[:PREVIEW_VALUES].tolist()
        summary["truncated"] = True
    scores = array[0] if array.ndim == 2 and array.shape[0] == 1 else array
    if scores.ndim == 1 and scores.size >= 10 and scores.dtype.kind == "f":
        top = np.argsort(scores)[::-1][:5]
        summary["top5"] = [{"index": int(i), "score": float(scores[i])} for i in top]
    return summary


def run_playground(deployment: Deployment, specs: dict[str, InputSpec]) -> PlaygroundResult:
    """One inference on the deployment's first READY placement, with the latency the client saw."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    placement = ready_placement(deployment)
    if placement is None:
        raise PlaygroundUnavailable(
            f"{deployment.model} has no READY instance yet (the deployment is {deployment.state}); "
            "try again once it is SERVING."
        )
    version = placement.served_version
    signature = ModelSignature.from_dict(version.signature)
    arrays = build_inputs(signature, specs)
    inputs = []
    for tensor in signature.inputs:
        array = arrays[tensor.name]
        item = httpclient.InferInput(tensor.name, list(array.shape), tensor.dtype)
        item.set_data_from_numpy(array)
        inputs.append(item)
    instance = placement.instance
    url = instance.endpoint_url()
    client = httpclient.InferenceServerClient(
        url.split("://", 1)[-1], connection_timeout=10, network_timeout=INFER_TIMEOUT
    )
    try:
        started = time.perf_counter()
        result = client.infer(deployment.triton_model_name(), inputs, headers=instance.key_headers())
        latency_ms = (time.perf_counter() - started) * 1000
    except InferenceServerException as exc:
        raise PlaygroundUnavailable(f"Triton on {instance} answered: {exc.message()}") from None
    except OSError as exc:  # connection refused/reset, timeouts (gevent and socket errors derive from it)
        raise PlaygroundUnavailable(f"Could not reach {instance} at {url}: {exc}") from None
    finally:
        client.close()
    outputs = []
    for tensor in signature.outputs:
        array = result.as_numpy(tensor.name)
        if array is not None:
            outputs.append(summarize_output(tensor.name, array))
    return PlaygroundResult(
        instance=str(instance),
        endpoint=url,
        version=version.number,
        latency_ms=latency_ms,
        inputs=[
            {
                "name": t.name,
                "mode": specs.get(t.name, InputSpec()).mode,
                "shape": list(arrays[t.name].shape),
                "datatype": t.dtype,
            }
            for t in signature.inputs
        ],
        outputs=outputs,
    )
