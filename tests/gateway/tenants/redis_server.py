"""A real redis-server (Debian's package, `make redis`) on a free loopback port, for the quota tests.

`RedisServer(tmp_path).start()` runs one with no persistence, `stop()` kills it (SIGKILL: as an
outage looks to a gateway), `start()` again brings it back on the same port (empty), `call(...)`
sends one command with redis-cli's protocol over a plain socket (no client library between the
test and the server).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.support import free_port, wait_for


class RedisServer:
    def __init__(self, directory: Path, password: str | None = None) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed: `make redis` installs Debian's package")
        self.directory, self.password = directory, password
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log = directory / f"redis-{self.port}.log"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.directory), "--logfile", str(self.log)]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_for(self._answers, timeout=30, what=lambda: self.log.read_text() if self.log.exists() else "no log")
        return self

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"redis-server exited {self.process.returncode}")
        try:
            return self.call("PING") == "PONG"
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self.process = None

    def call(self, *args: str) -> object:
        """One command, its decoded answer (str, int, list or None)."""
        commands = [("AUTH", self.password)] if self.password else []
        commands.append(args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            out = b"".join(
                f"*{len(c)}\r\n".encode() + b"".join(f"${len(a.encode())}\r\n{a}\r\n".encode() for a in c)
                for c in commands
            )
            sock.sendall(out)
            reader = sock.makefile("rb")
            answers = [_read(reader) for _ in commands]
        return answers[-1]


def _read(reader) -> object:
    line = reader.readline().rstrip(b"\r\n")
    kind, rest = line[:1], line[1:].decode()
    if kind == b"+":
        return rest
    if kind == b"-":
        raise AssertionError(f"redis error: {rest}")
    if kind == b":":
        return int(rest)
    if kind == b"$":
        if rest == "-1":
            return None
        data = reader.read(int(rest) + 2)
        return data[:-2].decode()
    if kind == b"*":
        return None if rest == "-1" else [_read(reader) for _ in range(int(rest))]
    raise AssertionError(f"unexpected redis answer {line!r}")
