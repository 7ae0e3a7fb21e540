"""The TorchScript encoder: a transformers encoder (or decoder used as one), pooling and L2 normalisation.

The exported module is device-portable: it runs on the device its weights and inputs are on. :func:`device_problems`
checks that of a saved module without a GPU.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

POOLINGS = ("mean", "cls", "lasttoken")
"""sentence-transformers ``Pooling`` modes the exported encoder computes."""


class PooledEncoder(torch.nn.Module):
    """Transformer + pooling + L2 normalisation, the computation of a Transformer/Pooling/Normalize pipeline.

    ``forward(input_ids int64 [B, T], attention_mask int64 [B, T]) -> float32 [B, dim]``, unit-norm rows.
    Pooling follows sentence-transformers' ``Pooling``: ``mean`` averages token embeddings where the mask is 1
    (denominator clamped at 1e-9), ``cls`` takes the first token, ``lasttoken`` the last token whose mask is 1 (rows
    are padded on the right). Normalisation is ``F.normalize(p=2, dim=1)``, as
    sentence-transformers' ``Normalize`` and ``encode(normalize_embeddings=True)`` do.

    The transformer gets the 2-D mask and builds its family's own attention mask from it (bidirectional, causal,
    sliding-window); :func:`follow_input_device` then unpins what that builder's trace recorded of the device.
    """

    def __init__(self, transformer: torch.nn.Module, pooling: str) -> None:
        """Wrap ``transformer`` (called with ``return_dict=False``) and pool with ``pooling`` (one of ``POOLINGS``)."""
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r} is not supported; supported: {', '.join(POOLINGS)}")
        self.transformer = transformer
        self.pooling = pooling

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Embed a padded batch; padding positions (mask 0) do not change any row's result."""
        tokens = self.transformer(input_ids=input_ids, attention_mask=attention_mask)[0]
        if self.pooling == "cls":
            pooled = tokens[:, 0]
        elif self.pooling == "lasttoken":
            last = (attention_mask.sum(1) - 1).clamp(min=0)  # gather, not arange: no device constant in the trace
            pooled = tokens.gather(1, last[:, None, None].expand(-1, 1, tokens.size(2))).squeeze(1)
        else:
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return F.normalize(pooled.float(), p=2, dim=1)


def follow_input_device(traced: torch.jit.ScriptModule) -> int:
    """Make every ``Device`` constant of ``traced`` the device of its first input, in place.

    A trace records ``torch.device("cpu")`` wherever the model's code names a device (``arange(..., device=...)``,
    ``zeros(..., device=...)``, ``mask.to(device)``): the position ids, token type ids and attention masks of every
    transformers family. The forward graph is inlined (submodule calls replaced by their bodies, weights still read
    from the submodules) and each such constant replaced by ``prim::device(input_ids)``, so the module runs on
    whatever device its inputs are on. One rewrite for every architecture: it works on the graph, not on any
    model's code.

    Returns:
        How many constants were replaced.
    """
    graph = traced.graph
    torch._C._jit_pass_inline(graph)
    input_ids = list(graph.inputs())[1]  # 0 is self
    device = None
    replaced = 0
    for node in list(graph.findAllNodes("prim::Constant")):
        if node.output().type().kind() != "DeviceObjType":
            continue
        if device is None:
            device = graph.create("prim::device", [input_ids])
            device.output().setType(node.output().type())
            device.insertBefore(next(iter(graph.nodes())))
        node.output().replaceAllUsesWith(device.output())
        node.destroy()
        replaced += 1
    return replaced


def describe(st_model, model_path: Path) -> dict:
    """Check that ``st_model`` is Transformer -> Pooling [-> Normalize] and return what the export needs.

    Returns:
        ``{"transformer_path": Path, "pooling": one of POOLINGS, "dim": int, "max_seq_length": int}``.

    Raises:
        ValueError: another module layout (Dense layers, a tokenizer module of its own), an unsupported pooling, or
            pooling that leaves the prompt's tokens out.
    """
    modules = json.loads((model_path / "modules.json").read_text())
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        raise ValueError(f"{model_path}: modules {kinds} are not Transformer, Pooling[, Normalize]")
    pooling = st_model[1].get_config_dict().get("pooling_mode")
    if pooling not in POOLINGS:
        raise ValueError(f"{model_path}: pooling_mode {pooling!r} is not supported; supported: {', '.join(POOLINGS)}")
    if st_model[1].get_config_dict().get("include_prompt", True) is False:
        raise ValueError(
            f"{model_path}: Pooling include_prompt=false (prompt tokens left out of pooling) is not supported"
        )
    # get_embedding_dimension in sentence-transformers >= 6, get_sentence_embedding_dimension before it.
    get_dim = getattr(st_model, "get_embedding_dimension", None) or st_model.get_sentence_embedding_dimension
    return {
        "transformer_path": model_path / modules[0]["path"],
        "pooling": pooling,
        "dim": int(get_dim()),
        "max_seq_length": int(st_model.max_seq_length),
    }


ATTENTION = "sdpa"
"""transformers' attention implementation the export traces: 0.9x eager's speed on short sentences, 1.3-1.6x at 256
tokens, memory linear in the length (docs/benchmarks.md, "Attention implementation")."""


PRECISIONS = ("fp32", "bf16", "fp16")
"""Precisions an exported module computes at: its matrix products' input dtype (outputs are always float32)."""
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def traced_at(precision: str) -> Iterator[None]:
    """Trace inside this to record ``precision`` in the module: CPU autocast to bf16 or fp16 (nothing for fp32).

    Autocast casts each matrix product's inputs to the reduced dtype and keeps reductions (softmax, layer norm,
    pooling sums) in float32. With the JIT's own autocast pass off, the trace records those casts as ``aten::to``
    nodes with a dtype and no device, so the module runs at that precision on the CPU and on a GPU alike.

    Raises:
        ValueError: ``precision`` is not one of ``PRECISIONS``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not supported; supported: {', '.join(PRECISIONS)}")
    if precision == "fp32":
        yield
        return
    jit_autocast = torch._C._jit_set_autocast_mode(False)
    try:
        with torch.autocast("cpu", dtype=_DTYPES[precision]):
            yield
    finally:
        torch._C._jit_set_autocast_mode(jit_autocast)


def remote_code_problem(transformer_path: Path) -> str | None:
    """Why the transformer in ``transformer_path`` cannot be exported, or None.

    A model whose ``config.json`` asks for code of its own (``auto_map``: ``trust_remote_code``) or names a
    ``model_type`` this transformers lacks cannot be; any other architecture is tried, and the export's check decides.
    """
    from transformers import CONFIG_MAPPING

    config_file = transformer_path / "config.json"
    if not config_file.is_file():
        return f"{transformer_path} has no config.json"
    config = json.loads(config_file.read_text())
    model_type = config.get("model_type")
    if "auto_map" in config:
        return (
            f"model_type '{model_type}' runs code shipped with the model (auto_map in {config_file}), which the "
            "exporter does not run (trust_remote_code)"
        )
    if model_type not in CONFIG_MAPPING:
        import transformers

        return f"model_type '{model_type}' is not an architecture of transformers {transformers.__version__}"
    return None


def build_traced_encoder(
    st_model, model_path: Path, *, attention: str = ATTENTION, precision: str = "fp32"
) -> tuple[torch.jit.ScriptModule, dict]:
    """Trace :class:`PooledEncoder` for the model in ``model_path``, device-portable.

    The transformer is reloaded with ``attn_implementation=attention`` (``eager`` for a family that has no SDPA
    implementation), tuple outputs and no KV cache, traced once under ``torch.no_grad()`` and
    :func:`traced_at` ``precision`` at (2, 16) with one padded row, and :func:`follow_input_device` applied.

    Returns:
        (traced module in eval mode on CPU, :func:`describe` output plus ``vocab_size``, ``model_type`` and
        ``attention``).

    Raises:
        ValueError: :func:`describe`'s.
    """
    from transformers import AutoModel

    info = describe(st_model, model_path)
    try:
        transformer = AutoModel.from_pretrained(
            str(info["transformer_path"]), attn_implementation=attention, return_dict=False
        ).eval()
    except ValueError:  # a family without an SDPA implementation (MPNet)
        transformer = AutoModel.from_pretrained(
            str(info["transformer_path"]), attn_implementation="eager", return_dict=False
        ).eval()
    info["attention"] = str(transformer.config._attn_implementation)
    transformer.config.use_cache = False  # decoders (Qwen3) would build an empty KV cache: a CPU tensor constant
    info["vocab_size"] = int(transformer.config.vocab_size)
    info["model_type"] = str(transformer.config.model_type)
    wrapper = PooledEncoder(transformer, info["pooling"]).eval()
    vocab = info["vocab_size"]
    example_ids = torch.randint(vocab // 2, vocab, (2, 16), dtype=torch.int64)
    example_mask = torch.ones_like(example_ids)
    example_mask[1, 9:] = 0
    return trace_portable(wrapper, (example_ids, example_mask), precision), info


def trace_portable(
    wrapper: torch.nn.Module, example: tuple[torch.Tensor, torch.Tensor], precision: str
) -> torch.jit.ScriptModule:
    """``wrapper`` traced on ``example``, made to follow its inputs' device.

    ``example``: ids and mask, int64 ``[B, T]``; traced under ``torch.no_grad()`` and :func:`traced_at`
    ``precision``, then :func:`follow_input_device`.

    Returns:
        The traced module in eval mode, on CPU.
    """
    with torch.no_grad(), traced_at(precision):
        traced = torch.jit.trace(wrapper, example, check_trace=False)
    follow_input_device(traced)
    return traced.eval()


def device_constants(module: torch.jit.ScriptModule) -> list[str]:
    """The constants in ``module``'s graph (submodules inlined) that would pin it to one device.

    A ``Device`` constant (``torch.device("cpu")`` in a ``to``, ``arange`` or ``zeros``) keeps its tensors on that
    device whatever the inputs are on. A tensor constant with elements would too; 0-dim tensor constants are
    scalars, which PyTorch combines with tensors on any device.

    Returns:
        One line per offending node (its text, source location included); empty when the module is portable.
    """
    problems = []
    blocks = [module.inlined_graph]
    while blocks:
        for node in blocks.pop().nodes():
            blocks.extend(node.blocks())
            if node.kind() != "prim::Constant":
                continue
            value = node.output().toIValue()  # a traced scalar constant reads back as a number
            if node.output().type().kind() == "DeviceObjType" or (isinstance(value, torch.Tensor) and value.dim() > 0):
                problems.append(str(node).strip())
    return problems


def move_to(module: torch.jit.ScriptModule, device: torch.device | str) -> torch.jit.ScriptModule:
    """Move ``module``'s parameters and buffers to ``device`` in place, leaving its constants where they are.

    ``ScriptModule.to`` does the same for CUDA; this also reaches devices it refuses, such as ``meta``.

    Returns:
        ``module``.
    """
    for submodule in module.modules():
        for name, param in list(submodule.named_parameters(recurse=False)):
            submodule._c.setattr(name, torch.nn.Parameter(param.detach().to(device), requires_grad=False))
        for name, buffer in list(submodule.named_buffers(recurse=False)):
            submodule._c.setattr(name, buffer.to(device))
    return module


def device_problems(module: torch.jit.ScriptModule) -> list[str]:
    """Why ``module`` would not run on a GPU, found on the CPU; empty when it is device-portable.

    Two checks: :func:`device_constants` on the graph, and a run of a saved-and-reloaded copy with weights and
    inputs on the ``meta`` device (shapes only, no data), where any tensor the graph puts on the CPU meets the meta
    ones and fails as it would on a GPU. The copy is loaded as the runner loads it (constants on the CPU, weights
    moved).

    Returns:
        Human-readable problems (device constants, then the meta run's error), empty when there are none.
    """
    problems = [f"device constant in the graph: {line}" for line in device_constants(module)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.pt"
        torch.jit.save(module, str(path))
        copy = move_to(torch.jit.load(str(path), map_location="cpu"), "meta")
    ids = torch.full((3, 12), 1000, dtype=torch.int64, device="meta")
    mask = torch.ones_like(ids)
    try:
        # The graph optimizer compares constants with aten::equal, which meta tensors lack.
        with torch.no_grad(), torch.jit.optimized_execution(False):
            out = copy(ids, mask)
    except (RuntimeError, NotImplementedError) as exc:
        last = [line.strip() for line in str(exc).splitlines() if line.strip()][-1]
        problems.append(f"a run with weights and inputs on the meta device failed: {last}")
    else:
        if out.device.type != "meta":
            problems.append(f"a run with weights and inputs on the meta device returned a {out.device} tensor")
    return problems


class PairScorer(torch.nn.Module):
    """A cross-encoder (``*ForSequenceClassification`` with one label) scoring (query, document) pairs.

    ``forward(input_ids int64 [B, T], segments int64 [B, T]) -> float32 [B, 2]``: per pair, the model's activation of
    its logit (``CrossEncoder.predict``'s score) and the raw logit. ``segments`` is the attention mask with the
    second text marked: 0 padding, 1 a token of the first text (and the specials around it), 2 a token of the second
    (the tokenizer's type id + 1), so the same two tensors as an embedder's carry a pair through the runner, its
    buckets and CUDA graphs. A family with token types gets ``token_type_ids`` = (segments == 2).
    """

    def __init__(self, model: torch.nn.Module, activation: torch.nn.Module, token_types: bool) -> None:
        """Wrap ``model`` (returns a tuple whose first item is ``[B, 1]`` logits) and ``activation``."""
        super().__init__()
        self.model = model
        self.activation = activation
        self.token_types = token_types

    def forward(self, input_ids: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """Score a padded batch of pairs; padding positions (0) do not change any row's result."""
        mask = (segments > 0).to(torch.int64)
        if self.token_types:
            types = (segments == 2).to(torch.int64)
            logits = self.model(input_ids=input_ids, attention_mask=mask, token_type_ids=types, return_dict=False)[0]
        else:
            logits = self.model(input_ids=input_ids, attention_mask=mask, return_dict=False)[0]
        logits = logits.float()
        return torch.cat([self.activation(logits), logits], dim=1)


def build_traced_scorer(cross_encoder, *, precision: str = "fp32") -> tuple[torch.jit.ScriptModule, dict]:
    """Trace :class:`PairScorer` for a sentence-transformers ``CrossEncoder``, device-portable.

    Traced as :func:`build_traced_encoder` traces (:func:`trace_portable` on an example batch with a padded row),
    with the model's own attention implementation and its ``activation_fn`` (sigmoid for one label unless its
    config names another).

    Returns:
        (traced module in eval mode on CPU, ``{"max_seq_length", "vocab_size", "model_type", "attention",
        "activation"}``).

    Raises:
        ValueError: the model has more than one label, or its activation is not a ``torch.nn`` module.
    """
    import inspect

    model = cross_encoder[0].auto_model.eval()
    labels = int(model.config.num_labels)
    if labels != 1:
        raise ValueError(f"a reranker has one label (one score per pair); this model has {labels}")
    activation = cross_encoder.activation_fn
    if not isinstance(activation, torch.nn.Module):
        raise ValueError(f"activation_fn {activation!r} is not a torch.nn module, which the export can trace")
    model.config.use_cache = False
    token_types = "token_type_ids" in inspect.signature(model.forward).parameters
    token_types = token_types and int(getattr(model.config, "type_vocab_size", 1)) > 1
    wrapper = PairScorer(model, activation, token_types).eval()
    vocab = int(model.config.vocab_size)
    example_ids = torch.randint(vocab // 2, vocab, (2, 16), dtype=torch.int64)
    example_segments = torch.ones_like(example_ids)
    example_segments[:, 8:] = 2
    example_segments[1, 12:] = 0
    traced = trace_portable(wrapper, (example_ids, example_segments), precision)
    info = {
        "max_seq_length": int(cross_encoder.max_seq_length),
        "vocab_size": vocab,
        "model_type": str(model.config.model_type),
        "attention": str(model.config._attn_implementation),
        "activation": type(activation).__name__.lower(),
    }
    return traced, info
