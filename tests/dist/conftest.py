"""tests/dist: every case here is marked `dist` (the gloo pools are in tests/conftest.py)."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/dist/" in str(item.fspath):
            item.add_marker(pytest.mark.dist)
