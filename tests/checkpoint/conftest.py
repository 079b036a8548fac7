"""`forked_python`: runs a script as `python -c` would, in a child forked from an interpreter that imported jax.

The crash-safety tests run children that save and then die (SIGKILL) or exit. Importing jax, orbax and
checkpoint is most of such a child's cost, so one interpreter per test module imports them once and
forks a child per script. At each fork no jax backend has started and no other thread runs (both are
checked: jax starts its backend, and its threads, on the first array, in the child). The child runs
the script with fresh globals and ends as an interpreter does (threading's exit hooks, atexit), so its
exit status is the script's own: 0, 1 on an exception, -9 when it SIGKILLs itself.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")

_ZYGOTE = textwrap.dedent(
    """
    import json, os, signal, sys, threading
    import jax.numpy, orbax.checkpoint, checkpoint, varstate
    from checkpoint import _checkpoint, _manager
    from checkpoint._storage import _files, _publish, _save

    for line in sys.stdin:
        script, args, out, err = json.loads(line)
        assert threading.active_count() == 1, threading.enumerate()  # forking is only safe with one thread
        assert not BACKENDS_STARTED, "a jax backend started before the fork"
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            sys.argv = ["-c", *args]
            signal.alarm(300)  # a child that hangs ends with -SIGALRM: the test fails instead of waiting forever
            break
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    else:
        sys.exit(0)
    exec(compile(script, "<string>", "exec"), {"__name__": "__main__"})  # globals as a fresh `python -c`'s
    """
)


class _Zygote:
    def __init__(self, directory: str, backends_started: str) -> None:
        self.directory, self.count = directory, 0
        script = _ZYGOTE.replace("BACKENDS_STARTED", backends_started)
        self.proc = subprocess.Popen([sys.executable, "-c", script], env=ENV, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def run(self, script: str, *args: str) -> subprocess.CompletedProcess:
        """Runs `script` with argv `args`: its exit status (-9 after SIGKILL), stdout and stderr."""
        self.count += 1
        out, err = (os.path.join(self.directory, f"child-{self.count}.{n}") for n in ("out", "err"))
        self.proc.stdin.write(json.dumps([script, list(args), out, err]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the forking interpreter died (exit {self.proc.wait(timeout=60)}); its stderr is above"
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(args, int(line), o.read(), e.read())


@pytest.fixture(scope="module")
def forked_python(tmp_path_factory, jax_private):
    """`forked_python(script, *args)`: like subprocess.run([python, "-c", script, *args]) with output captured."""
    zygote = _Zygote(str(tmp_path_factory.mktemp("children")), jax_private["backends_started"])
    yield zygote.run
    zygote.proc.stdin.close()
    assert zygote.proc.wait(timeout=60) == 0
    zygote.proc.stdout.close()
