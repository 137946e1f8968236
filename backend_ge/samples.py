"""Example requests generated from a model signature: smoke tests, the playground, and the client snippets
(the tritonclient script and the curl JSON body of the seed examples)."""

from __future__ import annotations

import json

import numpy as np

from backend_ge import dtypes
from backend_ge.config import ModelSignature, TensorSignature


def request_shape(tensor: TensorSignature, batched: bool, batch_size: int = 1) -> list[int]:
    """The full request shape: the batch dimension first when the model is batched; dynamic dims -> 1."""
    dims = [d if d > 0 else 1 for d in tensor.dims]
    return [batch_size, *dims] if batched else dims


def example_inputs(signature: ModelSignature, batch_size: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs of the right shape and type: floats in [0, 1), integers in [0, 10), booleans."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for tensor in signature.inputs:
        shape = request_shape(tensor, signature.batched, batch_size)
        dtype = dtypes.from_wire(tensor.dtype).numpy
        if dtype.kind == "f":
            arrays[tensor.name] = rng.random(shape, dtype=np.float32).astype(dtype)
        elif dtype.kind == "b":
            arrays[tensor.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            arrays[tensor.name] = rng.integers(0, 10, size=shape).astype(dtype)
    return arrays


def kserve_json_body(inputs: dict[str, np.ndarray]) -> dict:
    """A KServe v2 JSON inference body (seed example 1, step 5)."""
    return {
        "inputs": [
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": dtypes.from_numpy(array.dtype).wire_name,
                "data": array.flatten().tolist(),
            }
            for name, array in inputs.items()
        ]
    }


# The snippets read the API token from this environment variable, so no secret is ever shown on a page.
TOKEN_ENV = "TGP_TOKEN"


def curl_example(
    url: str, model_name: str, signature: ModelSignature, inline_limit: int = 64, auth: bool = False
) -> str:
    """A runnable curl command (seed example 1, step 5). Small inputs go inline; large ones (an image is
    150,528 values) are written to body.json by a short python one-liner first. ``auth`` adds the gateway's
    ``Authorization: Bearer $TGP_TOKEN`` header."""
    body = kserve_json_body(example_inputs(signature))
    endpoint = f"{url}/v2/models/{model_name}/infer"
    header = f'  -H "Authorization: Bearer ${TOKEN_ENV}" \\\n' if auth else ""
    if all(len(item["data"]) <= inline_limit for item in body["inputs"]):
        return (
            f"curl -X POST {endpoint} \\\n{header}  -H 'Content-Type: application/json' \\\n"
            f"  -d '{json.dumps(body)}'"
        )
    generated = []
    for item in body["inputs"]:
        fill = (
            "0.5" if item["datatype"] in ("FP32", "FP16") else ("True" if item["datatype"] == "BOOL" else "1")
        )
        count = int(np.prod(item["shape"]))
        generated.append(
            f'{{"name": "{item["name"]}", "shape": {item["shape"]}, "datatype": "{item["datatype"]}", "data": [{fill}] * {count}}}'
        )
    script = f'import json; print(json.dumps({{"inputs": [{", ".join(generated)}]}}))'
    return (
        f"python3 -c '{script}' > body.json\n"
        f"curl -X POST {endpoint} \\\n{header}  -H 'Content-Type: application/json' \\\n  -d @body.json"
    )


def tritonclient_example(
    url: str, model_name: str, signature: ModelSignature, auth: bool = False, grpc: bool = False
) -> str:
    """The seed's example-3 client script, filled in for this model; ``auth`` adds the gateway's token header
    (read from the ``TGP_TOKEN`` environment variable); ``grpc``: the same with ``tritonclient.grpc`` (``url``
    is then ``host:port``)."""
    host = url.split("://", 1)[-1]
    ssl = ", ssl=True" if url.startswith("https://") else ""
    headers = ", headers=headers" if auth else ""
    client, module = ("grpcclient", "grpc") if grpc else ("httpclient", "http")
    lines = ["import os"] if auth else []
    lines += ["import numpy as np", f"import tritonclient.{module} as {client}"]
    if auth:
        # tritonclient.grpc refuses the key "Authorization": gRPC metadata keys are lower case.
        key = "authorization" if grpc else "Authorization"
        lines += ["", f'headers = {{"{key}": "Bearer " + os.environ["{TOKEN_ENV}"]}}']
    lines += [
        "",
        f'client = {client}.InferenceServerClient(url="{host}"{ssl})',
        f'print("Server ready:", client.is_server_ready({"headers=headers" if auth and grpc else ""}))',
        f'print("Model ready:", client.is_model_ready("{model_name}"{headers}))',
        "",
        "inputs = []",
    ]
    for tensor in signature.inputs:
        shape = request_shape(tensor, signature.batched)
        np_type = dtypes.from_wire(tensor.dtype).numpy.name
        if np_type.startswith("float"):
            make = f"np.random.randn({', '.join(map(str, shape))}).astype(np.{np_type})"
        elif np_type == "bool":
            make = f"np.ones({tuple(shape)}, dtype=bool)"
        else:
            make = f"np.zeros({tuple(shape)}, dtype=np.{np_type})"
        lines += [
            f"data = {make}",
            f'inputs.append({client}.InferInput("{tensor.name}", list(data.shape), "{tensor.dtype}"))',
            "inputs[-1].set_data_from_numpy(data)",
        ]
    outputs = ", ".join(f'{client}.InferRequestedOutput("{t.name}")' for t in signature.outputs)
    lines += [
        "",
        f"outputs = [{outputs}]",
        f'results = client.infer(model_name="{model_name}", inputs=inputs, outputs=outputs{headers})',
    ]
    for tensor in signature.outputs:
        lines.append(f'print("{tensor.name}:", results.as_numpy("{tensor.name}").shape)')
    return "\n".join(lines) + "\n"
