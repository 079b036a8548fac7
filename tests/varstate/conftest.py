"""Fixtures for the varstate tests."""

import pytest

from varstate import Registry


@pytest.fixture
def reg():
    """A registry of the test's own, so names made under it do not depend on other tests."""
    return Registry()
