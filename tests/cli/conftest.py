"""Fixtures for the command-line tests: the dsakit binary in $DSAKIT_BUILD_DIR (default build/)."""
import os
import pathlib
import subprocess

import pytest


@pytest.fixture(scope="session")
def dsakit(build_file) -> pathlib.Path:
    return build_file("bin/dsakit", "dsakit_cli")


@pytest.fixture
def run(dsakit):
    """run(*args, env={...}) -> CompletedProcess; never a signal (a crash fails the test). The
    environment's dispatch, sparse-rows and sparse-form overrides are dropped; `env` sets
    variables."""

    def _run(*args, timeout=600, env=None):
        extra = env or {}
        env = dict(os.environ)
        env.pop("DSAKIT_DISPATCH", None)
        env.pop("DSAKIT_DENSE_KV_LEN_THRESHOLD", None)
        env.pop("DSAKIT_SPARSE_ROWS", None)
        env.pop("DSAKIT_SPARSE_FORM", None)
        env.update(extra)
        p = subprocess.run([str(dsakit), *map(str, args)], capture_output=True, text=True,
                           timeout=timeout, env=env)
        assert p.returncode >= 0, f"dsakit died by signal {-p.returncode}: {p.stderr}"
        assert "Traceback" not in p.stderr and "terminate called" not in p.stderr, p.stderr
        return p

    return _run
