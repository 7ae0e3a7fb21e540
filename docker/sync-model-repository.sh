#!/usr/bin/env bash
# sync-model-repository CONFIGS ARTIFACTS DEST [MODEL]: the one-shot `model-export` service of docker-compose.yml.
# DEST (the volume Triton mounts read-only) becomes CONFIGS (the host's model_repository, read-only) without its
# git-ignored artifacts, plus the encoder and tokenizer artifacts: with MODEL (a sentence-transformers folder), that
# model exported and self-checked here by `python -m triton_embed_server.export`; without it, ARTIFACTS (the packaged
# all-MiniLM-L6-v2 exported when the image was built), or with PRECISION set, the packaged model exported here at it.
# Every config's embedding width, token limit, buckets and precision are then set to the artifact's
# (encoder/1/export.json), whatever the host's configs say. MODELS: more models served beside that one, each its
# own ensemble, as `make model MODEL=FOLDER NAME=NAME` adds them: NAME=FOLDER entries separated by spaces or commas,
# FOLDER (a sentence-transformers folder) relative to MODELS_ROOT (default /src/models, where compose and Kubernetes
# mount MODELS_DIR's folder) or absolute, each exported and self-checked here at PRECISION (empty: auto). DEST
# changes only once all of that succeeded.
# PYTHON: the interpreter that imports triton_embed_server (default python3). PRECISION: auto, fp32, bf16 or fp16
# (make model's; empty: auto with MODEL, the image's artifacts without). EXPORT_DEVICE: cpu or gpu, what auto picks
# for (default gpu: the compose and Kubernetes configs serve on GPUs).
set -euo pipefail
if [[ $# -lt 3 || $# -gt 4 ]]; then
    echo "usage: sync-model-repository CONFIGS ARTIFACTS DEST [MODEL]" >&2
    exit 2
fi
configs="$1" artifacts="$2" dest="$3" model="${4:-}"
python="${PYTHON:-python3}"
for path in "$configs" "$artifacts" "$dest" ${model:+"$model"}; do
    [[ -d "$path" ]] || { echo "sync-model-repository: $path is not a folder" >&2; exit 2; }
done
if [[ ! -f "$configs/embed/config.pbtxt" ]]; then
    echo "sync-model-repository: $configs has no embed/config.pbtxt" >&2
    exit 2
fi
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
# the default model's configs only (the other templates, a reranker's, are written by each MODELS export): the
# version folders' artifacts (*/1/*) come from the export, whatever the host holds
for step in embed tokenizer encoder; do
    (cd "$configs" && find "$step" -path '*/[0-9]*/*' -prune -o -type f -exec cp --parents {} "$stage" \;)
    (cd "$configs" && find "$step" -mindepth 1 -maxdepth 1 -type d -name '[0-9]*' -exec mkdir -p "$stage"/{} \;)
done
precision="${PRECISION:-}" device="${EXPORT_DEVICE:-gpu}"
if [[ -n "$model" || -n "$precision" ]]; then
    echo "sync-model-repository: exporting ${MODEL:-${model:-the packaged model}} at precision ${precision:-auto}" >&2
    "$python" -m triton_embed_server.export --model "${model:-default}" --repository "$stage" --force \
        --templates "$configs" --precision "${precision:-auto}" --device "$device" >&2
else
    cp -R "$artifacts"/. "$stage"/
fi
"$python" - "$stage" <<'PY'
import json
import sys
from pathlib import Path

from triton_embed_server.model_config import set_config_dims

repository = Path(sys.argv[1])
manifest = json.loads((repository / "encoder" / "1" / "export.json").read_text())
dim = manifest["dim"]
for config in set_config_dims(repository, dim, manifest["max_seq_length"], manifest.get("precision", "fp32")):
    where = config.relative_to(repository)
    print(f"sync-model-repository: the model's values (width {dim}) in {where}", file=sys.stderr)
PY
models_root="${MODELS_ROOT:-/src/models}" models="${MODELS:-}"
read -r -a entries <<<"${models//,/ }"
for entry in "${entries[@]}"; do
    name="${entry%%=*}" folder="${entry#*=}"
    if [[ "$entry" != *=* || -z "$name" || -z "$folder" ]]; then
        echo "sync-model-repository: MODELS entry '$entry' is not NAME=FOLDER" >&2
        exit 2
    fi
    if [[ "$name" == embed ]]; then
        echo "sync-model-repository: MODELS entry '$entry': embed is MODEL's (or the packaged model's) name" >&2
        exit 2
    fi
    [[ "$folder" == /* ]] || folder="$models_root/$folder"
    [[ -d "$folder" ]] || { echo "sync-model-repository: MODELS entry '$entry': $folder is not a folder" >&2; exit 2; }
    echo "sync-model-repository: exporting $folder as '$name' at precision ${precision:-auto}" >&2
    "$python" -m triton_embed_server.export --model "$folder" --name "$name" --repository "$stage" --force \
        --templates "$configs" --precision "${precision:-auto}" --device "$device" >&2
done
find "$dest" -mindepth 1 -delete
cp -R "$stage"/. "$dest"/
echo "sync-model-repository: $(find "$dest" -type f | wc -l) files in $dest:" >&2
(cd "$dest" && find . -type f | sort) >&2
