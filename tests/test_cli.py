"""`python -m server`: every command's flags, and `--help` without the heavy imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]

FLAGS = {
    "engine-args": ["--format", "--host", "--port", "--launcher"],
    "plan": ["--device-memory", "--json"],
    "check": [],
    "tiny-model": ["--force"],
    "engine": ["--host", "--port", "--max-restarts", "--ready-timeout"],
    "up": ["--config", "--host", "--port"],
    "serve": ["--config", "--upstream", "--host", "--port"],
    "compose": ["--config", "--output", "--check"],
    "helm-values": ["--config", "--output", "--check"],
}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server", *args], check=False, capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_every_command_is_listed_with_its_flags(capsys):
    listed = run_cli("--help")
    assert listed.returncode == 0
    for command, flags in FLAGS.items():
        assert command in listed.stdout
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args([command, "--help"])
        assert done.value.code == 0
        usage = capsys.readouterr().out
        for flag in flags:
            assert flag in usage, (command, flag)


def test_parsing_a_command_imports_neither_torch_nor_the_gateway():
    code = (
        "import sys; from server.cli import build_parser; build_parser().parse_args(['up']); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'vllm', 'fastapi', "
        "'uvicorn'} or m.startswith(('server.gateway', 'server.deploy'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["bogus"], ["plan"], ["serve", "--port", "x"]])
def test_bad_arguments_exit_2(argv):
    done = run_cli(*argv)
    assert done.returncode == 2 and "usage:" in done.stderr
