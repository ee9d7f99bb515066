"""Every `-m depthscale...` module the docs tell a user (or torchrun) to run can be run: a
renamed or removed entry point (`python -m depthscale.train`, gone when workers moved to
`python -m depthscale train`) is caught here rather than by a user's launch."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_module_the_docs_run_is_runnable():
    named = {
        (page.name, m)
        for page in PAGES
        for m in re.findall(r"-m\s+(depthscale(?:\.\w+)*)", page.read_text(encoding="utf-8"))
    }
    assert named, "the docs run no depthscale module: the pattern is stale"
    broken = []
    for page, module in sorted(named):
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:  # a package
            spec = importlib.util.find_spec(module + ".__main__")
        if spec is None:
            broken.append(f"{page}: -m {module}")
    assert not broken, f"modules the docs run that cannot run: {broken}"
