"""A real PostgreSQL server for the server store's tests: found on this machine or installed from
Debian's packages (as root), started in a folder of its own on a Unix socket alone, one fresh
database per test. Skipped, saying why, where no server can be had."""

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

STARTUP_S = 60


def _binaries() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), reverse=True)
    if found:
        return found[0].parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def _installed() -> tuple[Path | None, str]:
    """The server's binaries, installing Debian's postgresql package where they are missing and
    this is root; else None and why."""
    if (found := _binaries()) is not None:
        return found, ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "PostgreSQL is not installed, and installing it needs root and apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "postgresql"]):
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode:
            return None, f"{' '.join(argv)} failed: {done.stderr.strip()[-300:]}"
    found = _binaries()
    return found, "" if found else "postgresql installed, but no initdb was found"


def _as_server_user(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run it as the package's postgres user."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def postgres_server():
    """(socket folder, port, user) of a server running for this session."""
    pytest.importorskip("psycopg", reason="the server store needs psycopg (pip install 'psycopg[binary]')")
    binaries, why = _installed()
    if binaries is None:
        pytest.skip(f"no PostgreSQL server for the server store's tests: {why}")
    folder = Path(tempfile.mkdtemp(prefix="gemmtune-pg-"))
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
    data, port, user = folder / "data", _free_port(), "gemmtune"
    subprocess.run(_as_server_user([str(binaries / "initdb"), "-D", str(data), "-A", "trust", "-U", user]),
                   check=True, capture_output=True, timeout=STARTUP_S)
    options = f"-k {folder} -p {port} -c listen_addresses=''"
    subprocess.run(_as_server_user([str(binaries / "pg_ctl"), "-D", str(data), "-o", options, "-l",
                                    str(folder / "log"), "-w", "-t", str(STARTUP_S), "start"]),
                   check=True, capture_output=True, timeout=STARTUP_S + 10)
    try:
        yield folder, port, user
    finally:
        subprocess.run(_as_server_user([str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w",
                                        "stop"]), capture_output=True, timeout=STARTUP_S)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server):
    """The URL of a database made for this test alone."""
    import psycopg

    folder, port, user = postgres_server
    name = f"t{uuid.uuid4().hex[:12]}"
    with psycopg.connect(host=str(folder), port=port, user=user, dbname="postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield f"postgresql://{user}@/{name}?host={folder}&port={port}"
    with psycopg.connect(host=str(folder), port=port, user=user, dbname="postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")
