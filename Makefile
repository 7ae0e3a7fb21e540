# triton-embed: `make serve` and `make test` set up everything they need (venv, packages, model export).
SHELL := /bin/bash
# The interpreter that makes .venv: 3.11 or 3.12 (Triton 2.51's Python backend stub needs numpy < 2, which has no
# wheels for 3.13; docs/configuration.md, "Python versions").
PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
PYTHON_CHECK := import sys; v = sys.version_info[:2]; v in ((3, 11), (3, 12)) or sys.exit( \
	f"make: Python 3.11 or 3.12 needed for the server, found {sys.version.split()[0]} at {sys.executable}: install " \
	"one (pyenv install 3.12, or uv python install 3.12) and run make again with PYTHON=<its python3.12>")
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

# Model to export: empty = the model exported last under NAME, else the packaged all-MiniLM-L6-v2; or a
# sentence-transformers folder (make model MODEL=path); default = the packaged one.
MODEL ?=
# The model's name, its ensemble in Triton: empty = embed (with MODEL), or every model exported (without MODEL: make
# serve brings each up to date). Another name adds a model beside the others: make model MODEL=path NAME=multi.
NAME ?=
# Where make model writes the repository Triton serves (git-ignored; the tracked model_repository/ holds its templates).
MODEL_REPOSITORY ?= .build/model_repository
# What the encoder computes at: auto (bf16 on a CPU with native bf16, else fp32), fp32, bf16 or fp16; a reduced
# precision must reach MIN_COSINE to fp32 sentence-transformers on every calibration text (CORPUS's too, when given).
# Empty: what the model was exported at before (auto for a new one).
PRECISION ?=
MIN_COSINE ?=
# Embedded server binds loopback by default; HOST=0.0.0.0 opens it to the network.
HOST ?= 127.0.0.1
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
# The OpenAI/TEI HTTP gateway beside the server (0: none).
GATEWAY_PORT ?= 8080
# Seconds make serve waits for the model to be READY; a long max_seq_length warms up for minutes on a CPU.
READY_TIMEOUT ?= 300
PYTEST_ARGS ?=
# make test: pytest-xdist workers, each on cores of its own (tests/conftest.py); default: one per core, at most 4.
TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))')
# make loadtest / loadtest-ui / capacity: where the server is, which model (NAME; default embed; RERANK: a reranker
# called beside it) and how hard to push
# (defaults fit a 2-core machine).
TRITON_HOST ?= 127.0.0.1
USERS ?= 8
SPAWN_RATE ?= 8
RUN_TIME ?= 60s
SLA_MS ?= 200
LOCUST_ARGS ?=
CAPACITY_USERS ?= 1,2,4,8,16,32
CAPACITY_STEP_S ?= 30
LOCUST := $(PY) -m locust -f loadtest/locustfile.py --triton-host $(TRITON_HOST) --http-port $(HTTP_PORT) \
	--grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --sla-ms $(SLA_MS) $(if $(NAME),--model $(NAME)) \
	$(if $(RERANK),--rerank-model $(RERANK))

.PHONY: install peers client-test model remove-model reference-model serve test unit lint typecheck tune bench bench-encoder bench-precision bench-overload bench-bulk bench-rerank bench-idle-models perf-data clean loadtest loadtest-ui capacity system-deps gpu-carry

install: $(STAMP)

# pip byte-compiles each wheel's files one at a time (~60 s of the lock's ~85 s on 2 cores); compileall compiles them
# on every core afterwards (~23 s). Like pip, it does not stop on a file this Python cannot compile (torch ships a
# Python-3.12-only test module).
COMPILE = $(1) -m compileall -q -j0 "$$($(1) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
	>/dev/null || true

$(STAMP): requirements.lock pyproject.toml
	@$(PYTHON) -c '$(PYTHON_CHECK)'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check pip==25.3 setuptools==84.2.1
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -r requirements.lock
	$(call COMPILE,$(PY))
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

# The peer server make bench measures beside triton-embed: Infinity in a venv of its own (its pins conflict with the
# project's: transformers < 5, numpy < 2), from bench/peers/infinity.lock.
PEERS_STAMP := .build/peers/infinity/.installed-stamp
peers: $(PEERS_STAMP)

$(PEERS_STAMP): bench/peers/infinity.lock $(STAMP)
	test -x .build/peers/infinity/bin/python || $(PYTHON) -m venv .build/peers/infinity
	.build/peers/infinity/bin/python -m pip install --quiet --disable-pip-version-check pip==25.3
	.build/peers/infinity/bin/python -m pip install --quiet --disable-pip-version-check --no-compile \
		-r bench/peers/infinity.lock
	$(call COMPILE,.build/peers/infinity/bin/python)
	touch $@

# Re-exports only when the source model, the exporter, the chosen precision or a given gate changed (export.py checks,
# before torch loads).
# Without MODEL: the model exported last (make model MODEL=... once, then make serve serves it); MODEL=default: the
# packaged all-MiniLM-L6-v2.
model: install
	$(PY) -m triton_embed_server.export --repository "$(MODEL_REPOSITORY)" $(if $(MODEL),--model "$(MODEL)") \
		$(if $(NAME),--name "$(NAME)") $(if $(PRECISION),--precision $(PRECISION)) \
		$(if $(MIN_COSINE),--min-cosine $(MIN_COSINE)) $(if $(CORPUS),--corpus "$(CORPUS)")

# Deletes the model NAME from the served repository (make remove-model NAME=multi).
remove-model: install
	$(PY) -m triton_embed_server.export --repository "$(MODEL_REPOSITORY)" --remove "$(NAME)"

# The packaged all-MiniLM-L6-v2 at fp32 as embed, in a repository of its own (make serve's stays as exported): the
# tests compare the served embeddings with sentence-transformers' to 1e-5 (tests/conftest.py points them at it);
# the bf16 tests and bench's triton-auto export copies of their own.
REFERENCE_REPOSITORY := .build/reference_repository
reference-model: install
	$(PY) -m triton_embed_server.export --repository "$(REFERENCE_REPOSITORY)" --model default --precision fp32

serve: model
	$(PY) -m triton_embed_server serve --host $(HOST) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
		--metrics-port $(METRICS_PORT) --gateway-port $(GATEWAY_PORT) --ready-timeout $(READY_TIMEOUT) \
		--model-repository "$(MODEL_REPOSITORY)"

# Everything, as CI runs it: tests/unit, ruff and mypy (tests/test_lint.py), and the tests against a real server
# (tests/test_bench.py runs make bench in miniature, Infinity included). Two tiers: every test but the whole_machine
# ones on TEST_WORKERS workers, each pinned to its own cores, then the whole_machine ones alone on every core. Both
# tiers run; the target fails if either fails (pytest's 5, nothing selected, counts as passed for one tier).
test: system-deps
	@$(MAKE) --no-print-directory -j2 reference-model peers
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not whole_machine" $(PYTEST_ARGS); parallel=$$?; \
	$(PY) -m pytest -m whole_machine $(PYTEST_ARGS); whole=$$?; \
	echo "make test: parallel tier exit $$parallel, whole-machine tier exit $$whole"; \
	{ [ $$parallel -eq 0 ] || [ $$parallel -eq 5 ]; } && { [ $$whole -eq 0 ] || [ $$whole -eq 5 ]; } && \
	[ $$parallel$$whole != 55 ]

# Tools the deployment tests run (tests/test_deploy.py): Debian's docker-compose 1.29 (validates docker-compose.yml
# offline), prometheus 2.42 (promtool and the server, which the tests start themselves on a loopback port) and nginx
# 1.22 (tests/test_replicas.py: the L7 ingress in front of three replicas, on a loopback port).
# Installed only when missing. The package's service is not started: policy-rc.d denies it during the install
# (a temporary one when the machine has none), and on a systemd host it is disabled again.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
system-deps:
	@if ! command -v docker-compose >/dev/null || ! command -v promtool >/dev/null \
			|| ! command -v prometheus >/dev/null || ! command -v nginx >/dev/null; then \
		set -e; own_policy=; \
		if [ ! -e /usr/sbin/policy-rc.d ]; then \
			printf '#!/bin/sh\nexit 101\n' | $(SUDO) tee /usr/sbin/policy-rc.d >/dev/null; \
			$(SUDO) chmod 755 /usr/sbin/policy-rc.d; own_policy=1; \
		fi; \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -q; \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			docker-compose prometheus nginx; \
		if [ -n "$$own_policy" ]; then $(SUDO) rm -f /usr/sbin/policy-rc.d; fi; \
		if [ -d /run/systemd/system ]; then $(SUDO) systemctl disable --now prometheus nginx || true; fi; \
	fi

# The client library, the gateway and the monitor on any Python 3.10-3.13 (make client-test PYTHON=python3.13): a
# venv of their own under .build/, installed from pyproject.toml's ranges, and the unit tests that need no more.
CLIENT_VERSION = $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
CLIENT_VENV = .build/client-py$(CLIENT_VERSION)
client-test:
	@$(PYTHON) -c 'import sys; (3, 10) <= sys.version_info[:2] <= (3, 13) or sys.exit( \
		f"make client-test: Python 3.10-3.13 needed, found {sys.version.split()[0]} at {sys.executable}")'
	test -x $(CLIENT_VENV)/bin/python || $(PYTHON) -m venv $(CLIENT_VENV)
	$(CLIENT_VENV)/bin/python -m pip install --quiet --disable-pip-version-check pip==25.3
	$(CLIENT_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -e ".[gateway,tracing,monitor]" \
		pytest==9.2.0 pytest-timeout==2.4.0 "hypothesis>=6.168,<7"
	$(CLIENT_VENV)/bin/python -m pytest tests/unit -m "not full_install" -p no:cacheprovider $(PYTEST_ARGS)

# Pure-logic tests only: no server, no model export; seconds.
unit: install
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# mypy on the client, gateway and monitor packages, with the files and strictness of [tool.mypy] in pyproject.toml.
typecheck: install
	$(PY) -m mypy

clean:
	rm -rf .build .pytest_cache

# Side-by-side benchmark (in-process ceiling, naive FastAPI server, Infinity, Triton fixed-128, Triton buckets, the
# gateway), then tracing's cost through the gateway: off, following load, every request (bench/tracing.py), then
# rerank throughput (bench/rerank.py); ~14 min.
bench: reference-model peers
	TRITON_EMBED_MODEL_REPOSITORY="$(REFERENCE_REPOSITORY)" $(PY) -m bench.run $(BENCH_ARGS)

# A capacity search on this machine, model and texts (CORPUS=file, one text a line; default STS-B): the encoder's
# instances x threads, the batcher's queue delay and the bucket grid, each served and swept; the best is written into
# the served repository's encoder/config.pbtxt with the figures in its header (bench/tune.py; a re-export starts from the
# template again); ~2 min a candidate.
tune: model
	$(PY) -m bench.tune --repository "$(MODEL_REPOSITORY)" $(if $(CORPUS),--corpus "$(CORPUS)") $(TUNE_ARGS)

# The exported encoder's variants in process beside sentence-transformers (bench/encoder.py); ~4 min.
bench-encoder: install
	$(PY) -m bench.encoder $(BENCH_ARGS)

# The served encoder at fp32 and at make model's default precision, perf_analyzer on each (bench/precision.py); ~6 min.
bench-precision: install
	$(PY) -m bench.precision $(BENCH_ARGS)

# Overload figures side by side (docs/overload.md): perf_analyzer sweep with the shipped budget and with budget 0,
# no-backoff loops at 64 and 256 clients and Poisson bursts at 1.5x and 3x capacity from wrk (Debian's, installed
# when missing) and from Python clients, against the shipped server and one without the door; ~20 min.
bench-overload: reference-model
	@command -v wrk >/dev/null || { $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -q \
		&& $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends wrk; }
	TRITON_EMBED_MODEL_REPOSITORY="$(REFERENCE_REPOSITORY)" $(PY) -m bench.overload $(BENCH_ARGS)

# Rerank throughput alone (bench/rerank.py, make bench's last table): a stand-in of ms-marco-MiniLM-L6-v2's size
# served as a reranker, pairs/s at p99 <= 200 ms for a query with 16 and 64 documents beside in-process
# CrossEncoder.predict and Infinity; ~4 min.
bench-rerank: install
	$(PY) -m bench.rerank $(BENCH_ARGS)

# Bulk work beside one-text requests (bench/bulk.py): 4 one-text loops, 32 loops of 64-text requests with
# latency_budget_ms 0, then both, on the packaged model at PRECISION, all retrying at once over gRPC; ~3 min.
bench-bulk: install
	$(PY) -m bench.bulk --precision $(PRECISION) $(BENCH_ARGS)

# Idle models' cost to the busy one (bench/idle_models.py): perf_analyzer on embed served alone, beside two idle
# models (a second embedder and a reranker), and beside them with spinning OpenMP threads; ~10 min a round.
bench-idle-models: model
	$(PY) -m bench.idle_models $(BENCH_ARGS)

# perf_analyzer's --input-data file (bench/perf_data.py): 200,000 texts never sent before, from STS-B or CORPUS=file.
PERF_DATA ?= .build/perf-texts.json
perf-data: install
	$(PY) -m bench.perf_data $(if $(CORPUS),--corpus "$(CORPUS)") --out $(PERF_DATA)

# What bench/gpu_check.py needs on the GPU machine, under .build/gpu-carry (pytriton and nvidia-ml-py wheels for
# Python 3.12, MiniLM's config and tokenizer files); prints the device tool's carry list and command line.
gpu-carry: install
	$(PY) -m bench.gpu_carry

# Locust against a running server (`make serve` in another terminal): SLA gate + report in loadtest/runs/<time>/.
loadtest: install
	$(LOCUST) --headless --users $(USERS) --spawn-rate $(SPAWN_RATE) --run-time $(RUN_TIME) --stop-timeout 10 \
		$(LOCUST_ARGS)

# Locust's web UI on http://127.0.0.1:8089 (loopback only); each run still writes its report.
loadtest-ui: install
	$(LOCUST) --web-host 127.0.0.1 --users $(USERS) --spawn-rate $(SPAWN_RATE) $(LOCUST_ARGS)

# Highest throughput that passes the SLA gate, stepping the users through CAPACITY_USERS (30 s per step).
capacity: install
	$(PY) -m loadtest.capacity --users $(CAPACITY_USERS) --step-s $(CAPACITY_STEP_S) -- --triton-host $(TRITON_HOST) --http-port $(HTTP_PORT) \
		--grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --sla-ms $(SLA_MS) $(LOCUST_ARGS)
