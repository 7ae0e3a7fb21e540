# triton-embed: `make serve` and `make test` set up everything they need (venv, packages, model export).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

# Model to export: empty = packaged all-MiniLM-L6-v2; or a sentence-transformers folder (make model MODEL=path).
MODEL ?=
# Embedded server binds loopback by default; HOST=0.0.0.0 opens it to the network.
HOST ?= 127.0.0.1
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
PYTEST_ARGS ?=

.PHONY: install model serve test lint bench clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 needed, got {sys.version.split()[0]} at {sys.executable}"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check pip==25.3 setuptools==84.2.1
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

# Re-exports only when the source model or the exporter changed (checked in export.py, before torch loads).
model: install
	$(PY) -m triton_embed_server.export $(if $(MODEL),--model "$(MODEL)")

serve: model
	$(PY) -m triton_embed_server serve --host $(HOST) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
		--metrics-port $(METRICS_PORT)

test: model
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf .build .pytest_cache
	find model_repository -path '*/1/*' ! -name .gitkeep -delete

# Side-by-side benchmark (in-process ceiling, naive FastAPI server, Triton fixed-128, Triton buckets); ~10 min.
bench: model
	$(PY) -m bench.run $(BENCH_ARGS)
