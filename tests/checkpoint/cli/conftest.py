"""Fixtures for the command-line tests."""

import pytest

import checkpoint._cli._main as cli


@pytest.fixture
def run(capsys):
    """Runs the CLI in this process with the given arguments: (exit code, stdout, stderr)."""

    def run(*argv):
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run
