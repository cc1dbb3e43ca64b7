"""What the deployment's containers are: pinned images, paths and ports inside them, start-up and drain times.

Shared by the compose renderer (server.deploy.compose and the services it renders) and the Helm
values (server.deploy.helm), so both deploy the same images with the same layout.
"""

from __future__ import annotations

# Images, pinned. The vLLM image tag follows the vLLM release the project is tested with.
VLLM_GPU_IMAGE = "vllm/vllm-openai:v0.32.0"
VLLM_CPU_IMAGE = "llm-serving/vllm-cpu:0.32.0"  # built from docker/Dockerfile.vllm-cpu
GATEWAY_IMAGE = "llm-serving/gateway:0.1.0"  # built from docker/Dockerfile.gateway

GATEWAY_PORT = 8000
# The gateway container sees the checkout's configs/ at /app/configs and its rendered config at
# /app/docker/gateway.yaml, so the profile paths in that config (../configs/profiles/...) resolve
# the same inside the container and in the checkout.
GATEWAY_CONFIG_IN_CONTAINER = "/app/docker/gateway.yaml"
CONFIGS_IN_CONTAINER = "/app/configs"
# The host address the gateway is published on: this host only, unless the operator publishes it
# (GATEWAY_BIND=0.0.0.0; `make up` does so when GATEWAY_API_KEYS is set, and refuses it without).
GATEWAY_BIND = "${GATEWAY_BIND:-127.0.0.1}"
# Where Docker/vLLM keep downloaded weights, shared by every engine through one volume (or a
# host folder named by HF_CACHE_DIR, e.g. an existing ~/.cache/huggingface).
HF_HOME = "/cache/huggingface"
HF_CACHE_VOLUME = "${HF_CACHE_DIR:-hf-cache}"
# vLLM's own cache (VLLM_CACHE_ROOT: torch.compile artefacts under torch_compile_cache/), on a
# volume so a recreated engine container loads its compiled graphs instead of compiling again.
VLLM_CACHE = "/cache/vllm"
# docker/Dockerfile.vllm-cpu builds the project's tiny model here at image build time.
TINY_MODEL_IN_IMAGE = "/models/tiny-llama"
# Local model folders other than the tiny model are bind-mounted read-only under this folder.
MODELS_IN_CONTAINER = "/models"

# Start-up grace before a failing /health counts: a GPU engine may first download 16 GB of
# weights; the CPU engine imports vLLM in about a minute on two cores.
START_PERIOD = {"gpu": "30m", "cpu": "10m"}

# vLLM's own drain (0.32: `--shutdown-timeout` seconds; its default, 0, aborts in-flight requests at
# SIGTERM): an engine being stopped lets its requests finish for this long, unless its profile sets
# `shutdown-timeout` itself. The Helm chart's engine pods get the same by default
# (engineTerminationGraceSeconds 60, minus 10). Docker waits the drain plus STOP_MARGIN_SECONDS
# before SIGKILL (its own default is 10 s), as it waits the gateway's shutdown_grace plus a margin.
ENGINE_DRAIN_SECONDS = 50
STOP_MARGIN_SECONDS = 10
GATEWAY_STOP_MARGIN_SECONDS = 5

# The one check both engine images can run: python is in both, curl in neither for sure.
HEALTH_PROBE = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=5)"
