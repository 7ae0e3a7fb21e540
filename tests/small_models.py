"""Model repositories for tests: tiny random-weight models, and copies of the shipped one with edited knobs.

:func:`small_sentence_transformer` builds a sentence-transformers folder of any architecture in
:data:`ARCHITECTURES`: a 2-layer transformer of the family's own transformers class with random weights, and a
tokenizer of the family's kind. BERT and DistilBERT use the packaged all-MiniLM-L6-v2 WordPiece tokenizer; the other
families' real tokenizers cannot be had offline, so one of the same kind (model, pre-tokenizer, special tokens and
their ids, post-processor, padding side) is trained here on a few hundred sentences with the ``tokenizers`` library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Family:
    """How to build a tiny model of one architecture.

    Attributes:
        model_type: transformers' ``model_type``.
        tokenizer: ``wordpiece`` (the packaged BERT one), ``mpnet-wordpiece``, ``roberta-bpe``, ``unigram``
            (XLM-RoBERTa's SentencePiece), ``modernbert-bpe`` or ``qwen-bpe``.
        pooling: the pooling the family's sentence-transformers models use.
        config: extra config fields (special token ids, attention layout).
        covers: real models of the family that this stands in for.
    """

    model_type: str
    tokenizer: str
    pooling: str = "mean"
    config: dict = field(default_factory=dict)
    covers: str = ""


ARCHITECTURES: dict[str, Family] = {
    "bert": Family("bert", "wordpiece", covers="all-MiniLM-L6-v2, bge-*-en-v1.5, e5-*-v2, gte-*"),
    "distilbert": Family("distilbert", "wordpiece", covers="msmarco-distilbert-*, multi-qa-distilbert-*"),
    "roberta": Family(
        "roberta",
        "roberta-bpe",
        config={"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
        covers="all-distilroberta-v1, stsb-roberta-*",
    ),
    "xlm-roberta": Family(
        "xlm-roberta",
        "unigram",
        config={"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
        covers="multilingual-e5-*, bge-m3, paraphrase-multilingual-mpnet-base-v2",
    ),
    "mpnet": Family(
        "mpnet",
        "mpnet-wordpiece",
        config={"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
        covers="all-mpnet-base-v2, multi-qa-mpnet-base-*",
    ),
    "modernbert": Family(
        "modernbert",
        "modernbert-bpe",
        config={
            "pad_token_id": 0,
            "cls_token_id": 1,
            "sep_token_id": 2,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "global_attn_every_n_layers": 2,
            "local_attention": 16,
        },
        covers="modernbert-embed-base, gte-modernbert-base",
    ),
    "qwen3": Family(
        "qwen3",
        "qwen-bpe",
        pooling="lasttoken",
        config={
            "num_key_value_heads": 1,
            "head_dim": 16,
            "pad_token_id": 0,
            "eos_token_id": 0,
            "bos_token_id": None,
            "tie_word_embeddings": True,
        },
        covers="Qwen3-Embedding-0.6B/4B/8B",
    ),
}
"""The architectures the exporter is tested on (tests/test_architectures.py), by name."""

_TEXT = (
    "the quick brown fox jumps over a lazy dog while people watch from the river bank and a man is playing a guitar "
    "on the stage as the crowd sings along under lights that change colour with every chorus of the song women and "
    "children eat bread cheese apples in the park near old houses trains cars boats planes fly high above cities "
    "ein mann spielt gitarre une femme mange du pain un niño juega con la pelota текст на русском языке "
    "日本語の文章を埋め込みます 中文文本 emoji 😀🎸🔥 symbols ©®™ ﬁ ligature ünïcödé accents numbers 0123456789"
)
_WORDS = _TEXT.split()


def _corpus() -> list[str]:
    """A few hundred sentences mixing scripts, for training the tiny tokenizers."""
    import random

    rng = random.Random(0)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 20))) for _ in range(400)] + _WORDS


def _trained_tokenizer(kind: str, folder: Path, max_length: int):
    """A ``PreTrainedTokenizerFast`` of ``kind`` (see :class:`Family`), saved into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    vocab = 600
    if kind == "mpnet-wordpiece":
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=specials)
        template = ("<s> $A </s>", "<s>", "</s>")
        names = {"bos_token": "<s>", "eos_token": "</s>", "cls_token": "<s>", "sep_token": "</s>"}
        names |= {"pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}
    elif kind == "unigram":
        specials = ["<s>", "<pad>", "</s>", "<unk>"]
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab, special_tokens=specials, unk_token="<unk>")
        template = ("<s> $A </s>", "<s>", "</s>")
        names = {"bos_token": "<s>", "eos_token": "</s>", "cls_token": "<s>", "sep_token": "</s>"}
        names |= {"pad_token": "<pad>", "unk_token": "<unk>"}
    else:  # byte-level BPE: RoBERTa, ModernBERT (OLMo's), Qwen
        specials = {
            "roberta-bpe": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
            "modernbert-bpe": ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"],
            "qwen-bpe": ["<|endoftext|>"],
        }[kind]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=kind == "roberta-bpe")
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, initial_alphabet=alphabet)
        if kind == "roberta-bpe":
            template = None
            names = {"bos_token": "<s>", "eos_token": "</s>", "cls_token": "<s>", "sep_token": "</s>"}
            names |= {"pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}
        elif kind == "modernbert-bpe":
            template = ("[CLS] $A [SEP]", "[CLS]", "[SEP]")
            names = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]"}
            names |= {"mask_token": "[MASK]"}
        else:  # Qwen3-Embedding appends <|endoftext|> to every text and pads with it, on the left
            template = ("$A <|endoftext|>", None, "<|endoftext|>")
            names = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    tok.train_from_iterator(_corpus(), trainer)
    if kind == "roberta-bpe":
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    else:
        single, first, last = template
        tokens = [(t, tok.token_to_id(t)) for t in (first, last) if t]
        # a pair as the family joins one (XLM-RoBERTa, MPNet: </s> </s> between; ModernBERT: [SEP]), one type id
        between = f"{last} {last}" if first == "<s>" else last
        pair = single.replace("$A", f"$A {between} $B") if last else f"{single} $B"
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)
    side = "left" if kind == "qwen-bpe" else "right"
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, padding_side=side, **names)
    hf.save_pretrained(folder)
    return hf


def _config(family: Family, vocab_size: int, dim: int, max_positions: int):
    from transformers import AutoConfig

    if family.model_type == "distilbert":
        fields = {"dim": dim, "n_layers": 2, "n_heads": 2, "hidden_dim": 2 * dim}
    else:
        fields = {"hidden_size": dim, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 2 * dim}
    fields |= {"vocab_size": vocab_size, "max_position_embeddings": max_positions, **family.config}
    return AutoConfig.for_model(family.model_type, **fields)


def _family_tokenizer(family: Family, folder: Path, max_length: int):
    """The family's tokenizer saved into ``folder``: the packaged MiniLM WordPiece one, or one trained here."""
    from transformers import AutoTokenizer
    from triton_embed_server.export import default_model_path

    if family.tokenizer != "wordpiece":
        return _trained_tokenizer(family.tokenizer, folder, max_length)
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path()))
    tokenizer.save_pretrained(folder)
    return tokenizer


def small_sentence_transformer(
    folder: Path,
    dim: int,
    *,
    architecture: str = "bert",
    pooling: str | None = None,
    max_seq_length: int = 128,
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
) -> Path:
    """A sentence-transformers folder: a 2-layer ``architecture`` (a key of :data:`ARCHITECTURES`) of width ``dim``
    with random weights, its family's tokenizer, ``pooling`` (default: the family's), a Normalize module when
    ``normalize``, and the given ``prompts``. Returns the model's folder."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st_modules
    from transformers import AutoModel

    family = ARCHITECTURES[architecture]
    hf_folder = folder / "hf"
    # RoBERTa-style position ids start at padding_idx + 1: two more positions than tokens
    config = _config(family, len(_family_tokenizer(family, hf_folder, max_seq_length)), dim, max_seq_length + 2)
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(hf_folder)
    modules = [
        st_modules.Transformer(str(hf_folder), max_seq_length=max_seq_length),
        st_modules.Pooling(dim, pooling or family.pooling),
        *([st_modules.Normalize()] if normalize else []),
    ]
    model = SentenceTransformer(modules=modules, device="cpu", prompts=prompts, default_prompt_name=default_prompt_name)
    model.save(str(folder / "model"))
    return folder / "model"


def repository_for(model: Path, repo: Path, precision: str = "fp32", name: str = "embed") -> Path:
    """``model`` exported into the served repository ``repo`` as the model ``name`` at ``precision`` (its configs from
    the project's templates, with its widths, limit, buckets and precision). fp32 by default: the tests compare with
    sentence-transformers to 1e-5. Models already in ``repo`` stay."""
    from triton_embed_server import export as exporter

    exporter.export(model, repo, precision=precision, name=name)
    return repo


RERANKER_ARCHITECTURES = {
    "bert": "cross-encoder/ms-marco-MiniLM-L6-v2, BAAI/bge-reranker-base's BERT cousins",
    "xlm-roberta": "BAAI/bge-reranker-v2-m3, bge-reranker-base/large",
    "modernbert": "Alibaba-NLP/gte-reranker-modernbert-base",
}
"""The reranker families the exporter is tested on (tests/test_rerank.py), with the real models they stand in for."""


def small_cross_encoder(folder: Path, *, architecture: str = "bert", dim: int = 32, max_seq_length: int = 64) -> Path:
    """A sentence-transformers CrossEncoder folder: a 2-layer ``architecture`` ``*ForSequenceClassification`` with one
    label, width ``dim`` and random weights, its family's tokenizer (pairs joined as the family joins them), and the
    default activation (sigmoid). Returns the model's folder."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification

    family = ARCHITECTURES[architecture]
    hf_folder = folder / "hf"
    config = _config(family, len(_family_tokenizer(family, hf_folder, max_seq_length)), dim, max_seq_length + 2)
    config.num_labels = 1
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    # random weights score every pair near one value; a wider classifier spreads them, so ranks are worth checking
    head = next(p for n, p in model.named_parameters() if n.endswith("weight") and p.shape[0] == 1)
    torch.nn.init.normal_(head, std=2.0)
    model.save_pretrained(hf_folder)
    CrossEncoder(str(hf_folder), device="cpu", max_length=max_seq_length).save(str(folder / "model"))
    return folder / "model"
