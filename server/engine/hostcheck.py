"""Refuse, before anything starts, a profile that cannot run on this host, and say why.

A vLLM engine that cannot work usually says so only after 40 s of imports (fp8 KV cache on an
AVX2 CPU, a tool-call or reasoning parser it does not know) or not at all (a max-model-len the KV
memory cannot hold). These checks run in a second, at `python -m server check` and before every
launch.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.engine.kv import PlanError, text_config
from server.engine.planner import load_model_config, plan_profile
from server.engine.profiles import FP8_KV_CACHE_DTYPES, Profile, load_profile, resolve_profile_path


@dataclass(frozen=True)
class HostInfo:
    """The facts about this machine the checks depend on (injected in tests)."""

    machine: str
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    gpu_count: int = 0

    @classmethod
    def detect(cls) -> HostInfo:
        """This machine. SERVER_HOST_CPU_FLAGS (comma-separated) replaces the CPU flags read
        from /proc/cpuinfo, so the refusals can be shown on any host."""
        override = os.environ.get("SERVER_HOST_CPU_FLAGS")
        if override is not None:
            return cls(
                machine=platform.machine(),
                gpu_count=_count_gpus(),
                cpu_flags=frozenset(f.strip() for f in override.split(",") if f.strip()),
            )
        flags: set[str] = set()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("flags"):
                    flags.update(line.partition(":")[2].split())
                    break
        except OSError:
            pass
        return cls(machine=platform.machine(), cpu_flags=frozenset(flags), gpu_count=_count_gpus())

    @property
    def is_x86(self) -> bool:
        return self.machine in {"x86_64", "AMD64", "i686"}

    @property
    def has_avx512_or_amx(self) -> bool:
        return "avx512f" in self.cpu_flags or any(f.startswith("amx") for f in self.cpu_flags)


def _count_gpus() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def check_profile(profile: Profile, host: HostInfo | None = None) -> list[str]:
    """Every reason this profile cannot run here; an empty list means go."""
    host = host or HostInfo.detect()
    problems: list[str] = []
    dtype = profile.kv_cache_dtype

    if profile.device == "cpu":
        if host.is_x86 and not ({"avx2", "avx512f"} & host.cpu_flags):
            problems.append("vLLM's CPU backend needs AVX2 or AVX-512 on x86; this CPU has neither")
        if dtype in FP8_KV_CACHE_DTYPES and not (host.is_x86 and host.has_avx512_or_amx):
            problems.append(
                f"kv-cache-dtype {dtype} on CPU needs x86 with AVX-512 or AMX; this CPU "
                f"({host.machine}, {'AVX2' if 'avx2' in host.cpu_flags else 'no AVX2'}) has neither. "
                "vLLM would fail about 40 s after launch with 'FP8 KV cache on CPU requires x86 "
                "with AVX-512 or AMX.' Use kv-cache-dtype: auto"
            )
    else:
        gpus_needed = profile.gpus_per_node  # tensor x pipeline x this node's data-parallel ranks
        if host.gpu_count == 0:
            problems.append(
                "this is a GPU profile (device: gpu) and this host has no NVIDIA GPU "
                "(nvidia-smi finds none); use a CPU profile such as tiny-cpu"
            )
        elif host.gpu_count < gpus_needed:
            problems.append(
                f"tensor x pipeline x local data parallel size is {gpus_needed} GPUs; this host has {host.gpu_count}"
            )

    problems += check_parsers(profile)

    path = profile.model_path
    if path is not None and not path.exists() and not profile.build_tiny_model:
        problems.append(f"model path {path} does not exist")

    try:
        config, config_path = load_model_config(profile)
    except PlanError:
        return problems  # a hub model without a shipped config: nothing more to check offline
    limit = model_max_len(config)
    if profile.max_model_len and limit and profile.max_model_len > limit:
        problems.append(
            f"max-model-len {profile.max_model_len} is above the model's limit of {limit} tokens ({config_path})"
        )
    try:
        plan = plan_profile(profile, config=config)
    except PlanError:
        return problems  # no memory figure (GPU without --device-memory): vLLM will size it
    if plan.max_concurrent_sequences < 1:
        problems.append(
            f"the KV cache ({plan.kv_memory_bytes / 2**20:,.0f} MiB = {plan.kv_cache_tokens:,} tokens) "
            f"cannot hold one sequence of max-model-len {plan.max_model_len:,} tokens; raise "
            "VLLM_CPU_KVCACHE_SPACE or lower max-model-len"
        )
    return problems


@dataclass(frozen=True)
class ParserNames:
    """The names `--tool-call-parser` and `--reasoning-parser` accept in the installed vLLM."""

    tool: frozenset[str]
    reasoning: frozenset[str]


# Where vLLM keeps its name -> (file, class) tables; vLLM's own registries are filled from them.
_PARSER_TABLES = {
    "tool": ("tool_parsers/__init__.py", "_TOOL_PARSERS_TO_REGISTER"),
    "reasoning": ("reasoning/__init__.py", "_REASONING_PARSERS_TO_REGISTER"),
}


def installed_parser_names() -> ParserNames | None:
    """The parser names the installed vLLM registers, or None without vLLM (or when its files
    no longer hold the tables this reads).

    Read from the package's source with `ast`: importing vLLM's registries takes about 20 s
    (they pull in torch), this takes milliseconds.
    """
    try:
        spec = importlib.util.find_spec("vllm")  # a top-level package: found, not imported
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return parser_names_in(Path(next(iter(spec.submodule_search_locations))))


def parser_names_in(package: Path) -> ParserNames | None:
    """The parser names registered by the vLLM package at `package` (its folder)."""
    names = {}
    for kind, (relative, table) in _PARSER_TABLES.items():
        try:
            tree = ast.parse((package / relative).read_text())
        except (OSError, SyntaxError, ValueError):
            return None
        found = _dict_keys(tree, table)
        if not found:
            return None
        names[kind] = found
    return ParserNames(tool=names["tool"], reasoning=names["reasoning"])


def _dict_keys(tree: ast.Module, variable: str) -> frozenset[str]:
    """The string keys of a module-level `variable = {...}` literal."""
    for node in tree.body:
        value: ast.expr | None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == variable for t in targets) and isinstance(value, ast.Dict):
            return frozenset(k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return frozenset()


def plugin_parser_names(plugin: Path) -> frozenset[str]:
    """Names a parser plugin file registers: the string (or list of strings) given to
    `register_module(...)` or `register_lazy_module(...)` (as decorator or call)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(plugin.read_text())):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"register_module", "register_lazy_module"}
        ):
            continue
        given = [kw.value for kw in node.keywords if kw.arg == "name"] or node.args[:1]
        for value in given:
            items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
            names.update(i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str))
    return frozenset(names)


def check_parsers(profile: Profile, names: ParserNames | None = None) -> list[str]:
    """Tool-call and reasoning parsers that vLLM would refuse only after its imports (or,
    for auto tool choice without a parser, at argument parsing). `names` defaults to the
    installed vLLM's; without vLLM installed, unknown names cannot be told and pass."""
    flags = profile.vllm
    problems: list[str] = []
    if flags.get("enable-auto-tool-choice") is True and not flags.get("tool-call-parser"):
        problems.append(
            "enable-auto-tool-choice needs tool-call-parser (the parser that reads "
            "the model's tool calls, e.g. hermes, llama3_json, mistral)"
        )
    names = names if names is not None else installed_parser_names()
    for kind, flag in (("tool", "tool-call-parser"), ("reasoning", "reasoning-parser")):
        value = flags.get(flag)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            problems.append(f"{flag}: expected a parser name, got {value!r}")
            continue
        if names is None:
            continue
        known = set(getattr(names, kind))
        plugin = flags.get(f"{kind}-parser-plugin")
        if isinstance(plugin, str) and plugin:
            plugin_path = Path(plugin)
            if not plugin_path.is_absolute() and profile.source is not None:
                plugin_path = profile.source.parent / plugin_path
            try:
                known |= plugin_parser_names(plugin_path)
            except (OSError, SyntaxError, ValueError) as exc:
                problems.append(f"{kind}-parser-plugin {plugin} cannot be read ({exc})")
                continue
        if value not in known:
            problems.append(
                f"{flag} {value!r} is not a {kind} parser the installed vLLM knows; "
                "valid names: " + ", ".join(sorted(known))
            )
    return problems


def model_max_len(config: dict[str, Any]) -> int | None:
    """The longest context the model supports: max_position_embeddings, stretched by
    rope scaling factors that extend it (yarn, dynamic, linear)."""
    cfg = text_config(config)
    base = cfg.get("max_position_embeddings")
    if not base:
        return None
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in {"yarn", "dynamic", "linear"} and scaling.get("factor"):
        original = scaling.get("original_max_position_embeddings") or base
        return int(max(base, original * float(scaling["factor"])))
    return int(base)


def refuse_message(profile: Profile, problems: list[str]) -> str:
    return f"profile {profile.name} cannot run on this host:\n" + "\n".join(f"  - {p}" for p in problems)


def check_command(profile_name: str) -> int:
    """`python -m server check`: OK (exit 0), or the reasons a profile cannot run here (exit 1)."""
    profile = load_profile(resolve_profile_path(profile_name))
    problems = check_profile(profile)
    if problems:
        print(refuse_message(profile, problems), file=sys.stderr)
        return 1
    print(f"profile {profile.name}: OK on this host")
    return 0
