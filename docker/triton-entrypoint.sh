#!/usr/bin/env bash
# Entrypoint of the triton-embed image: runs tritonserver with the arguments given (docker-compose.yml's
# `command:`) plus the admin-API lock the embedded server uses (server/triton_embed_server/embedded.py):
# model repository, shared memory, logging and trace need the header triton-embed-admin-key on HTTP (gRPC:
# metadata triton-grpc-protocol-triton-embed-admin-key) with the key from TRITON_EMBED_ADMIN_KEY. Without that
# variable a random key is made at every start, so the admin APIs are closed to everyone.
#
# Environment: TRITON_EMBED_ADMIN_KEY (optional), TRITONSERVER (the binary; default: tritonserver on PATH).
set -euo pipefail

# NGC images set up the CUDA environment (driver checks, forward-compatibility libraries) in their own entrypoint;
# go through it once when it is there.
if [[ -z "${TRITON_EMBED_VIA_NVIDIA_ENTRYPOINT:-}" && -x /opt/nvidia/nvidia_entrypoint.sh ]]; then
    export TRITON_EMBED_VIA_NVIDIA_ENTRYPOINT=1
    exec /opt/nvidia/nvidia_entrypoint.sh "$0" "$@"
fi

restricted_apis="model-repository,shared-memory,logging,trace"
admin_header="triton-embed-admin-key"
admin_key="${TRITON_EMBED_ADMIN_KEY:-}"
if [[ -z "$admin_key" ]]; then
    admin_key="$(head -c 24 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')"
    echo "triton-embed: TRITON_EMBED_ADMIN_KEY is not set: admin APIs locked with a random key" >&2
fi
if [[ ! "$admin_key" =~ ^[A-Za-z0-9._~-]+$ ]]; then
    echo "triton-embed: TRITON_EMBED_ADMIN_KEY may hold only letters, digits and . _ ~ - (it goes into a flag)" >&2
    exit 2
fi

exec "${TRITONSERVER:-tritonserver}" "$@" \
    "--http-restricted-api=${restricted_apis}:${admin_header}=${admin_key}" \
    "--grpc-restricted-protocol=${restricted_apis}:${admin_header}=${admin_key}"
