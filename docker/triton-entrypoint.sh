#!/usr/bin/env bash
# Entrypoint of the triton-embed image: runs tritonserver with the arguments given (docker-compose.yml's
# `command:`) plus the admin-API lock the embedded server uses (server/triton_embed_server/embedded.py):
# model repository, shared memory, logging and trace need the header triton-embed-admin-key on HTTP (gRPC:
# metadata triton-grpc-protocol-triton-embed-admin-key) with the key from TRITON_EMBED_ADMIN_KEY. Without that
# variable a random key is made at every start, so the admin APIs are closed to everyone but the watchdog below.
#
# It also starts the stub watchdog (server/triton_embed_server/supervisor.py, stdlib only), a Triton 2.51 workaround
# (docs/troubleshooting.md, as is the drain below): Triton 2.51 does not
# restart a Python backend stub that died, so the watchdog reloads that model through the repository API (hence
# --model-control-mode=explicit in docker-compose.yml) with the admin key. It watches tritonserver's stubs from its
# start (one that dies while other models still load is reloaded once the server answers), reaches it on 127.0.0.1
# at --http-port (default 8000), and exits after it.
#
# And it drains on SIGTERM/SIGINT (`docker compose stop`): Triton 2.51's own shutdown refuses a request whose
# encoder step has not started ("Server is stopping"), so this script stays in front of tritonserver, and on the
# signal first unloads the `embed` ensemble (server/triton_embed_server/drain.py: new requests are refused, those
# in flight finish, for up to TRITON_EMBED_DRAIN_TIMEOUT seconds), then sends tritonserver SIGTERM (`make serve`
# sends SIGINT; Triton treats both alike) and exits with its status: 0 also when the watchdog had to kill a
# tritonserver that waited only for a stub that died (Triton 2.51 would wait out its exit timeout, then exit 1).
#
# Before tritonserver starts, a GPU config meets the driver check (server/triton_embed_server/driver_check.py,
# stdlib only): a driver too old for the image's CUDA gets one line (driver found, minimum, what to do) and exit
# status 78, instead of a server that fails at its first CUDA call.
#
# Environment: TRITON_EMBED_ADMIN_KEY (optional), TRITONSERVER (the binary; default: tritonserver on PATH),
# TRITON_EMBED_WATCH_STUBS (0: no watchdog), TRITON_EMBED_WATCHDOG, TRITON_EMBED_DRAIN and
# TRITON_EMBED_DRIVER_CHECK (the scripts; default: where the image puts them), TRITON_EMBED_DRAIN_TIMEOUT (seconds,
# default 30; 0: no drain).
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

http_port=8000
previous=""
for arg in "$@"; do
    if [[ "$arg" == --http-port=* ]]; then http_port="${arg#--http-port=}"; fi
    if [[ "$previous" == --http-port ]]; then http_port="$arg"; fi
    previous="$arg"
done

driver_check="${TRITON_EMBED_DRIVER_CHECK:-/opt/triton-embed/driver_check.py}"
if [[ -f "$driver_check" ]]; then
    python3 "$driver_check" "$@" </dev/null || exit $?
else
    echo "triton-embed: no driver check at $driver_check: tritonserver starts unchecked" >&2
fi

# OpenTelemetry's variables (OTEL_EXPORTER_OTLP_ENDPOINT & co) as tritonserver's --trace-config flags
# (server/triton_embed_server/tracing.py, stdlib only); none when the endpoint is unset.
tracer="${TRITON_EMBED_TRACING:-/opt/triton-embed/tracing.py}"
trace_args=()
if [[ -f "$tracer" ]]; then
    trace_flags="$(python3 "$tracer" </dev/null)" || exit 2  # a variable it cannot follow: the reason on stderr
    if [[ -n "$trace_flags" ]]; then mapfile -t trace_args <<<"$trace_flags"; fi
fi

server_pid=""
stopped_stuck=0
watchdog="${TRITON_EMBED_WATCHDOG:-/opt/triton-embed/supervisor.py}"  # the stub watchdog, also the stop's end
drain_then_stop() {
    trap '' TERM INT  # one drain; tritonserver's own exit timeout bounds the rest
    if [[ -z "$server_pid" ]]; then  # a signal right after the launch, before server_pid was set
        set +u; server_pid="$!"; set -u
    fi
    if [[ -z "$server_pid" ]]; then exit 143; fi  # before the launch: nothing to stop
    local drainer="${TRITON_EMBED_DRAIN:-/opt/triton-embed/drain.py}" timeout="${TRITON_EMBED_DRAIN_TIMEOUT:-30}"
    if [[ "$timeout" != 0 && -f "$drainer" ]]; then
        TRITON_EMBED_ADMIN_KEY="$admin_key" python3 "$drainer" --http-port "$http_port" \
            --admin-header "$admin_header" --timeout-s "$timeout" </dev/null || true
    elif [[ "$timeout" != 0 ]]; then
        echo "triton-embed: no drain script at $drainer: stopping without a drain" >&2
    fi
    kill -TERM "$server_pid" 2>/dev/null || true  # (a background job starts with SIGINT ignored)
    # Triton 2.51 waits out its exit timeout (and exits 1) for a model instance whose stub died with a request in
    # it; the watchdog's --finish-stop kills such a server once every live stub has exited (a clean stop).
    if [[ "${TRITON_EMBED_WATCH_STUBS:-1}" != 0 && -f "$watchdog" ]] \
        && python3 "$watchdog" --server-pid "$server_pid" --finish-stop </dev/null; then
        stopped_stuck=1
    fi
}
trap drain_then_stop TERM INT

"${TRITONSERVER:-tritonserver}" "$@" "${trace_args[@]}" \
    "--http-restricted-api=${restricted_apis}:${admin_header}=${admin_key}" \
    "--grpc-restricted-protocol=${restricted_apis}:${admin_header}=${admin_key}" </dev/null &
server_pid=$!

if [[ "${TRITON_EMBED_WATCH_STUBS:-1}" != 0 ]]; then
    if [[ -f "$watchdog" ]]; then
        TRITON_EMBED_ADMIN_KEY="$admin_key" python3 "$watchdog" --server-pid "$server_pid" --http-port "$http_port" \
            --admin-header "$admin_header" </dev/null &
    else
        echo "triton-embed: no stub watchdog at $watchdog: a crashed stub stays down until a restart" >&2
    fi
fi

# `wait` returns early (status > 128) when a trapped signal arrives: wait again until tritonserver has exited.
# If it exited during the drain, one more `wait` gives its status (127 when that was already given).
status=0
while :; do
    wait "$server_pid" && status=0 || status=$?
    if ! kill -0 "$server_pid" 2>/dev/null; then
        wait "$server_pid" 2>/dev/null && status=0 || { code=$?; if [[ $code != 127 ]]; then status=$code; fi; }
        break
    fi
done
if [[ "$stopped_stuck" == 1 ]]; then status=0; fi  # killed after a clean drain (see drain_then_stop)
exit "$status"
