"""Raw tritonclient calls the tests use to reach single steps and the statistics API."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def text_tensor(texts: list[str] | list[bytes]) -> np.ndarray:
    """[N, 1] object array of UTF-8 bytes, the TEXT layout the ensemble expects."""
    return np.array([[t.encode() if isinstance(t, str) else t] for t in texts], dtype=np.object_)


def infer(url: str, model: str, inputs: dict[str, np.ndarray], outputs: list[str], protocol: str = "grpc"):
    """Send one request with the given named inputs; return {output name: array}. Raises InferenceServerException."""
    module = grpcclient if protocol == "grpc" else httpclient
    client = module.InferenceServerClient(url)
    try:
        tensors = []
        for name, array in inputs.items():
            dtype = "BYTES" if array.dtype == np.object_ else "INT64"
            tensor = module.InferInput(name, list(array.shape), dtype)
            if protocol == "http":
                tensor.set_data_from_numpy(array, binary_data=True)
            else:
                tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        result = client.infer(model, tensors, outputs=[module.InferRequestedOutput(o) for o in outputs])
        return {o: result.as_numpy(o) for o in outputs}
    finally:
        client.close()


def counts(grpc_url: str, model: str) -> tuple[int, int]:
    """(inference_count, execution_count) of ``model`` from Triton's statistics API."""
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        stats = client.get_inference_statistics(model_name=model, as_json=True)["model_stats"][0]
    finally:
        client.close()
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))
