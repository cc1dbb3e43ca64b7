"""Small commands that only read a profile: `engine-args`."""

from __future__ import annotations

import argparse
import sys

from server.engine.profiles import load_profile, resolve_profile_path
from server.engine.render import engine_argv, engine_config, render_shell, render_yaml


def engine_args(args: argparse.Namespace) -> int:
    profile = load_profile(resolve_profile_path(args.profile))
    if args.format == "yaml":
        sys.stdout.write(render_yaml(engine_config(profile, host=args.host, port=args.port)))
        return 0
    argv = engine_argv(profile, host=args.host, port=args.port, launcher=args.launcher)
    if args.format == "argv":
        sys.stdout.write("\n".join(argv) + "\n")
    else:
        print(render_shell(argv, profile.env))
    return 0
