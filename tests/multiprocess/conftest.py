"""Launches a group of processes joined by jax.distributed on localhost (gloo collectives), with a hard timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Outcome:
    """One process's exit status, output and `RESULT` lines (name -> decoded JSON)."""

    process_id: int
    returncode: int
    output: str
    results: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"--- process {self.process_id} (exit {self.returncode}) ---\n{self.output[-6000:]}"


def launch(script: str, workdir: str, *args: str, processes: int = 2, timeout_s: float = 240,
           env: dict | None = None) -> list[Outcome]:
    """Runs `script` (in this folder) as `processes` processes of one group; kills them all after `timeout_s`."""
    port = free_port()
    children = []
    logs = []
    for i in range(processes):
        child_env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTEST_CURRENT_TEST")}
        child_env.update({
            "VARSTATE_TEST_PROCESS_ID": str(i), "VARSTATE_TEST_NUM_PROCESSES": str(processes),
            "VARSTATE_TEST_COORDINATOR": f"127.0.0.1:{port}", "VARSTATE_TEST_WORKDIR": workdir,
            "PYTHONPATH": os.pathsep.join([HERE, ROOT]), "PYTHONUNBUFFERED": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
        })
        child_env.update(env or {})
        log = open(os.path.join(workdir, f"process-{i}.log"), "w+")
        logs.append(log)
        children.append(subprocess.Popen([sys.executable, os.path.join(HERE, script), *args], env=child_env,
                                         stdout=log, stderr=subprocess.STDOUT, cwd=workdir))
    deadline = time.monotonic() + timeout_s
    codes = []
    for child in children:
        try:
            codes.append(child.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            for c in children:
                c.kill()
            codes.append(-9)
    for c in children:
        c.wait()
    outcomes = []
    for i, log in enumerate(logs):
        log.seek(0)
        text = log.read()
        log.close()
        results = {}
        for line in text.splitlines():
            if line.startswith("RESULT "):
                _, name, value = line.split(" ", 2)
                results[name] = json.loads(value)
        outcomes.append(Outcome(i, children[i].returncode if codes[i] != -9 else -9, text, results))
    return outcomes


def check(outcomes: list[Outcome]) -> list[Outcome]:
    """Fails the test (with every process's output) unless all exited 0."""
    if any(o.returncode != 0 for o in outcomes):
        pytest.fail("a process of the group failed:\n" + "\n".join(str(o) for o in outcomes), pytrace=False)
    return outcomes


@pytest.fixture
def group(tmp_path):
    """`group(script, *args, **kw)` runs the script as a 2-process jax.distributed group in tmp_path.

    Fails the test unless every process exits 0, except with ``all_succeed=False``.
    """

    def run(script: str, *args: str, all_succeed: bool = True, **kw) -> list[Outcome]:
        outcomes = launch(script, str(tmp_path), *args, **kw)
        return check(outcomes) if all_succeed else outcomes

    return run
