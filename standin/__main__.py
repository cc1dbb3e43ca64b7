"""`python -m standin --help`: one stand-in vLLM engine over HTTP (see standin/cli.py)."""

from standin.cli import main

main()
