"""A real PostgreSQL server for tests: Debian's binaries (/usr/lib/postgresql/*/bin), a fresh
cluster made by initdb in a temporary folder, listening on a free loopback port.

PostgreSQL refuses to run as root: when the tests run as root, the cluster belongs to the
`postgres` user the Debian package creates, and the server runs as that user. Tests that need
it are skipped when no binaries are installed (`make test` installs them: the Makefile's postgres target).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support import free_port

START_TIMEOUT = 120.0


def binaries() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


@dataclass
class PostgresServer:
    port: int
    data: Path
    bin: Path
    process: subprocess.Popen[bytes]
    user: str

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        if self.process.poll() is None:
            # SIGINT, fast shutdown: the clients' connections are dropped, as when a database
            # restarts or fails over (SIGTERM's smart shutdown waits for them: with a gateway's
            # pool holding one, it ended only at the kill below, 30 s later).
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def start_again(self) -> None:
        self.process = _start(self.bin, self.data, self.port, self.user)


def _as_user(user: str) -> dict[str, object]:
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid}


def _start(bin: Path, data: Path, port: int, user: str) -> subprocess.Popen[bytes]:
    options = ["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=300"]
    command = [str(bin / "postgres"), "-D", str(data), "-p", str(port), "-k", str(data.parent / "socket"), *options]
    with (data.parent / "postgres.log").open("ab") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **_as_user(user),  # type: ignore[arg-type]
        )
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        ready = subprocess.run(
            [str(bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)], capture_output=True, check=False
        )
        if ready.returncode == 0:
            return process
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("postgres did not start:\n" + (data.parent / "postgres.log").read_text()[-3000:])
        time.sleep(0.2)


@contextmanager
def postgres_server(folder: Path) -> Iterator[PostgresServer]:
    bin = binaries()
    assert bin is not None
    user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    if os.geteuid() == 0:  # a folder the server's user can reach (pytest's are root's alone)
        folder = Path(tempfile.mkdtemp(prefix="gateway-postgres-"))
        os.chmod(folder, 0o755)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "socket").mkdir(exist_ok=True)
    data = folder / "data"
    if os.geteuid() == 0:
        for path in (folder, folder / "socket"):
            shutil.chown(path, user, user)
    subprocess.run(
        [str(bin / "initdb"), "-D", str(data), "-U", user, "--auth=trust", "-E", "UTF8"],
        check=True,
        capture_output=True,
        **_as_user(user),  # type: ignore[arg-type]
    )
    port = free_port()
    server = PostgresServer(port, data, bin, _start(bin, data, port, user), user)
    try:
        yield server
    finally:
        server.stop()
        if os.geteuid() == 0:
            shutil.rmtree(folder, ignore_errors=True)
