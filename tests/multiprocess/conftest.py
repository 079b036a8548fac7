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


# A hang guard only: a group that deadlocks would otherwise hang the suite. The slowest group (child_train.py)
# takes well under a minute on 2 idle cores; 10 minutes leaves room for a machine loaded many times over.
HANG_GUARD_S = 600
# What process 0 prints when jax's coordination service cannot bind the port: another program took it between
# free_port closing its socket and the coordinator binding it. The group is then launched again on a new port.
PORT_TAKEN = "Failed to start RPC server"


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


def launch(script: str, workdir: str, *args: str, processes: int = 2, timeout_s: float = HANG_GUARD_S,
           env: dict | None = None) -> list[Outcome]:
    """Runs `script` (in this folder) as `processes` processes of one group; kills them all after `timeout_s`.
    Launches the group again (up to 3 times in all) when the coordinator finds its port taken."""
    for _ in range(3):
        outcomes = _launch_once(script, workdir, free_port(), args, processes, timeout_s, env)
        if PORT_TAKEN not in outcomes[0].output:
            break
    return outcomes


def _launch_once(script: str, workdir: str, port: int, args: tuple, processes: int, timeout_s: float,
                 env: dict | None) -> list[Outcome]:
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
    while any(c.poll() is None for c in children):
        # the others would wait for a coordinator that never started until jax's own timeout: end them now
        port_taken = children[0].returncode not in (None, 0) and PORT_TAKEN in _text(logs[0])
        if port_taken or time.monotonic() > deadline:
            for c in children:
                c.kill()  # exit status -9
        time.sleep(0.1)
    outcomes = []
    for i, log in enumerate(logs):
        text = _text(log)
        log.close()
        results = {}
        for line in text.splitlines():
            if line.startswith("RESULT "):
                _, name, value = line.split(" ", 2)
                results[name] = json.loads(value)
        outcomes.append(Outcome(i, children[i].returncode, text, results))
    return outcomes


def _text(log) -> str:
    with open(log.name) as f:  # not log.seek: the child shares that file offset while it runs
        return f.read()


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
