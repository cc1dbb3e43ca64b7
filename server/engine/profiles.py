"""Engine profiles: one YAML file describes one vLLM engine (and how many replicas of it).

A profile is data. Our own keys are validated strictly (unknown keys are errors); the vLLM
engine options live under ``vllm:`` with vLLM's own long flag names (``block-size``,
``kv-cache-dtype``...) and pass through untouched, so any flag vLLM grows works without a
change here. ``load_profile`` turns every problem into a ``ProfileError`` that names the file,
the key and what was expected.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from server.config import TrimmingConfig

# vLLM options we understand well enough to check and plan with. Anything else passes through.
KNOWN_KV_CACHE_DTYPES = {
    "auto",
    "float16",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
}
FP8_KV_CACHE_DTYPES = {"fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla"}
# Flags the engine launcher owns: a profile must not set them (they would fight the supervisor).
RESERVED_VLLM_FLAGS = {"host", "port", "model", "served-model-name", "config"}

VllmValue = str | int | float | bool | list[Any] | dict[str, Any] | None


class ProfileError(ValueError):
    """A profile that cannot be loaded or cannot work, with where and why."""


class PlannerHints(BaseModel):
    """What the KV-cache planner cannot read from config.json."""

    model_config = ConfigDict(extra="forbid")

    # config.json to plan with when `model` is a hub id (no hub here): a path relative to the
    # profile file, or absent to look under configs/models/<org>--<name>/config.json.
    model_config_path: str | None = None
    # Bytes of weights per GPU; estimated from config.json when absent.
    weights_bytes: int | None = Field(default=None, ge=0)


class LoraAdapter(BaseModel):
    """A LoRA adapter the engine serves from start-up (`--enable-lora --lora-modules NAME=PATH`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)  # what requests name as `model`
    path: str = Field(min_length=1)  # a local folder (relative to the profile file) or a hub id
    build_tiny: bool = False  # build the project's tiny adapter there when missing (server.engine.tinyadapter)

    def resolved_path(self, source: Path | None) -> str:
        """An absolute folder for a local path (vLLM may run elsewhere than our working directory)."""
        if not self.path.startswith(("/", "./", "../", "~")):
            return self.path
        path = Path(self.path).expanduser()
        if not path.is_absolute() and source is not None:
            path = source.parent / path
        return str(path.resolve())


class Profile(BaseModel):
    """One vLLM engine, as the operator describes it."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    name: str = ""  # defaults to the file's stem
    description: str = ""
    model: str
    served_model_name: str
    device: Literal["cpu", "gpu"] = "gpu"
    # Build the project's tiny model at `model` when it is missing (tiny-cpu only).
    build_tiny_model: bool = False
    replicas: int = Field(default=1, ge=1, le=64)
    # A hub model behind an accepted licence (meta-llama/*): downloading it needs HF_TOKEN, and
    # compose refuses to start without one (server.deploy.downloads).
    gated: bool = False
    env: dict[str, str] = Field(default_factory=dict)
    vllm: dict[str, VllmValue] = Field(default_factory=dict)
    trimming: TrimmingConfig = Field(default_factory=TrimmingConfig)
    planner: PlannerHints = Field(default_factory=PlannerHints)
    lora_adapters: list[LoraAdapter] = Field(default_factory=list)
    # Publish KV-cache events (vLLM --kv-events-config, ZMQ) for the gateway's precise prefix
    # routing; the renderer gives each engine its own endpoint (server.engine.render).
    kv_events: bool = False
    # The engine's CPU priority as Linux's nice value (0-19; higher yields sooner), set on the
    # process the supervisor starts and on its session's scheduling group, and inherited by
    # every process vLLM forks. For an engine whose model runs on the host's CPU beside the
    # gateway, whose compute bursts can hold a small host's cores for up to a second: at 10 the
    # gateway's loop never stalled, but a lone client's turns got slower, so no profile sets it
    # (docs/operate/flow-control.md, "Where the slow turns came from"). Engines started by
    # `python -m server engine`/`run` only; compose and Helm set CPU shares themselves.
    nice: int = Field(default=0, ge=0, le=19)

    # Set by load_profile: the file this came from (relative paths resolve against its folder).
    source: Path | None = Field(default=None, exclude=True)

    @field_validator("env", mode="before")
    @classmethod
    def _env_values_are_strings(cls, value: Any) -> Any:
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if isinstance(item, bool) or item is None or isinstance(item, (dict, list)):
                    raise ValueError(f"env.{key}: expected a string or number, got {item!r}")
                out[str(key)] = str(item)
            return out
        return value

    @field_validator("vllm")
    @classmethod
    def _check_vllm_flags(cls, value: dict[str, VllmValue]) -> dict[str, VllmValue]:
        for key in value:
            if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", key):
                hint = key.replace("_", "-").lstrip("-")
                raise ValueError(
                    f"vllm.{key}: expected vLLM's long flag name without dashes in front, such as {hint!r}"
                )
            if key in RESERVED_VLLM_FLAGS:
                raise ValueError(
                    f"vllm.{key}: set by the launcher; use the profile's own key instead "
                    "(model, served_model_name) or the command line (--port)"
                )
        _expect(value, "block-size", int, lambda v: v > 0 and v & (v - 1) == 0, "a power of two")
        _expect(value, "max-model-len", int, lambda v: v > 0, "a positive integer")
        _expect(value, "max-num-seqs", int, lambda v: v > 0, "a positive integer")
        _expect(value, "tensor-parallel-size", int, lambda v: v > 0, "a positive integer")
        _expect(value, "pipeline-parallel-size", int, lambda v: v > 0, "a positive integer")
        _expect(value, "data-parallel-size", int, lambda v: v > 0, "a positive integer")
        _expect(value, "data-parallel-size-local", int, lambda v: v > 0, "a positive integer")
        _expect(value, "enable-expert-parallel", bool, lambda v: True, "true or false")
        _expect(
            value,
            "gpu-memory-utilization",
            (int, float),
            lambda v: 0 < v <= 1,
            "a fraction in (0, 1]",
        )
        _expect(value, "enable-prefix-caching", bool, lambda v: True, "true or false")
        _expect(
            value,
            "kv-cache-dtype",
            str,
            lambda v: v in KNOWN_KV_CACHE_DTYPES,
            "one of " + ", ".join(sorted(KNOWN_KV_CACHE_DTYPES)),
        )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Profile:
        if self.build_tiny_model and not self.is_local_model:
            raise ValueError("build_tiny_model: needs `model` to be a local path")
        names = [adapter.name for adapter in self.lora_adapters]
        if len(set(names)) != len(names):
            raise ValueError("lora_adapters: two adapters share a name")
        if self.served_model_name in names:
            raise ValueError("lora_adapters: an adapter cannot be named like the served model")
        if self.kv_events and "kv-events-config" in self.vllm:
            raise ValueError("vllm.kv-events-config: set by `kv_events: true` (one endpoint per engine)")
        if self.data_parallel_size % self.data_parallel_size_local:
            raise ValueError(
                f"vllm.data-parallel-size-local: {self.data_parallel_size_local} does not divide "
                f"data-parallel-size {self.data_parallel_size} (every node runs as many ranks)"
            )
        space = self.env.get("VLLM_CPU_KVCACHE_SPACE")
        if space is not None:
            try:
                if float(space) <= 0:
                    raise ValueError
            except ValueError:
                raise ValueError(
                    f"env.VLLM_CPU_KVCACHE_SPACE: expected a positive number of GiB, got {space!r}"
                ) from None
        return self

    # -- derived facts -------------------------------------------------------------------------

    @property
    def is_local_model(self) -> bool:
        return self.model.startswith(("/", "./", "../", "~")) or self.model in {".", ".."}

    @property
    def model_path(self) -> Path | None:
        """The model folder on disk, or None for a hub id."""
        if not self.is_local_model:
            return None
        path = Path(self.model).expanduser()
        if not path.is_absolute() and self.source is not None:
            path = self.source.parent / path
        return path.resolve()

    @property
    def max_model_len(self) -> int | None:
        value = self.vllm.get("max-model-len")
        return value if isinstance(value, int) else None

    @property
    def block_size(self) -> int:
        value = self.vllm.get("block-size")
        if isinstance(value, int):
            return value
        return 128 if self.device == "cpu" else 16  # vLLM's platform defaults

    @property
    def kv_cache_dtype(self) -> str:
        value = self.vllm.get("kv-cache-dtype")
        return value if isinstance(value, str) else "auto"

    @property
    def tensor_parallel_size(self) -> int:
        value = self.vllm.get("tensor-parallel-size")
        return value if isinstance(value, int) else 1

    @property
    def pipeline_parallel_size(self) -> int:
        value = self.vllm.get("pipeline-parallel-size")
        return value if isinstance(value, int) else 1

    @property
    def data_parallel_size(self) -> int:
        value = self.vllm.get("data-parallel-size")
        return value if isinstance(value, int) else 1

    @property
    def data_parallel_size_local(self) -> int:
        """Data-parallel ranks on one node (vLLM's data-parallel-size-local; all of them by default)."""
        value = self.vllm.get("data-parallel-size-local")
        return value if isinstance(value, int) else self.data_parallel_size

    @property
    def enable_expert_parallel(self) -> bool:
        return self.vllm.get("enable-expert-parallel") is True

    @property
    def gpus_per_node(self) -> int:
        """GPUs one node (pod) of an engine holds: tensor x pipeline x its local data-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size_local

    @property
    def nodes(self) -> int:
        """Nodes one engine spans: its data-parallel ranks over those of one node."""
        return -(-self.data_parallel_size // self.data_parallel_size_local)

    @property
    def gpu_memory_utilization(self) -> float:
        value = self.vllm.get("gpu-memory-utilization")
        return float(value) if isinstance(value, (int, float)) else 0.92

    @property
    def cpu_kv_cache_bytes(self) -> int | None:
        """KV memory of a CPU engine: VLLM_CPU_KVCACHE_SPACE GiB (None when unset: auto-sized)."""
        space = self.env.get("VLLM_CPU_KVCACHE_SPACE")
        return int(float(space) * 2**30) if space else None


def _expect(values: dict[str, Any], key: str, types: Any, ok: Any, what: str) -> None:
    if key not in values or values[key] is None:
        return
    value = values[key]
    wrong_type = isinstance(value, bool) and bool not in _as_tuple(types)
    if wrong_type or not isinstance(value, types) or not ok(value):
        raise ValueError(f"vllm.{key}: expected {what}, got {value!r}")


def _as_tuple(types: Any) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def load_profile(path: str | Path) -> Profile:
    """Read and validate one profile file; every failure is a ProfileError naming the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such profile file") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: expected a mapping of profile keys, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    try:
        profile = Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(f"{path}: " + _describe(exc)) from None
    profile.source = path.resolve()
    return profile


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key (check the spelling; vLLM flags go under `vllm:`)"
        elif error["type"] == "missing":
            message = "required key is missing"
        elif "input" in error and error["type"] not in {"value_error"}:
            message = f"{message} (got {error['input']!r})"
        problems.append(f"{where}: {message}" if where and not message.startswith(where) else message)
    return "; ".join(problems)


def profiles_dir() -> Path:
    """configs/profiles of this checkout."""
    return Path(__file__).resolve().parents[2] / "configs" / "profiles"


def resolve_profile_path(name_or_path: str) -> Path:
    """Accept a path, or a bare profile name such as `tiny-cpu`."""
    path = Path(name_or_path)
    if path.exists() or path.suffix in {".yaml", ".yml"}:
        return path
    return profiles_dir() / f"{name_or_path}.yaml"
