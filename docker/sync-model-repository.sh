#!/usr/bin/env bash
# sync-model-repository CONFIGS ARTIFACTS DEST: the one-shot `model-export` service of docker-compose.yml.
# DEST (the volume Triton mounts read-only) becomes CONFIGS (the host's model_repository: configs, read-only)
# without its git-ignored artifacts, plus ARTIFACTS (the encoder and tokenizer files exported when the image was
# built). Run at every `docker compose up`, so config edits on the host reach the server on its next start.
set -euo pipefail
if [[ $# -ne 3 ]]; then
    echo "usage: sync-model-repository CONFIGS ARTIFACTS DEST" >&2
    exit 2
fi
configs="$1" artifacts="$2" dest="$3"
for path in "$configs" "$artifacts" "$dest"; do
    [[ -d "$path" ]] || { echo "sync-model-repository: $path is not a folder" >&2; exit 2; }
done
if [[ ! -f "$configs/embed/config.pbtxt" ]]; then
    echo "sync-model-repository: $configs has no embed/config.pbtxt" >&2
    exit 2
fi
find "$dest" -mindepth 1 -delete
# configs only: the version folders' artifacts (*/1/*) come from the image, whatever the host holds
(cd "$configs" && find . -path './*/[0-9]*/*' -prune -o -type f -exec cp --parents {} "$dest" \;)
(cd "$configs" && find . -mindepth 2 -maxdepth 2 -type d -name '[0-9]*' -exec mkdir -p "$dest"/{} \;)
cp -R "$artifacts"/. "$dest"/
echo "sync-model-repository: $(find "$dest" -type f | wc -l) files in $dest:" >&2
(cd "$dest" && find . -type f | sort) >&2
