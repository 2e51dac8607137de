"""Each folder of tests/ is named after the package it tests: `tests/<name>` is the top-level
package `<name>` or `serving.<name>` (serving's sub-packages: registry, gateway, engine, contracts), and a
folder below it is that package's sub-package (`tests/engine/server` is `serving.engine.server`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _package_of(folder: Path) -> str | None:
    parts = folder.relative_to(TESTS).parts
    for prefix in ((), ("serving",)):
        name = ".".join((*prefix, *parts))
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            continue
        # pytest puts tests/ on sys.path, where `engine` would find the test folder itself.
        if spec is not None and not any(Path(place).is_relative_to(TESTS)
                                        for place in spec.submodule_search_locations or ()):
            return name
    return None


def test_every_test_folder_is_named_after_a_package() -> None:
    folders = [path for path in TESTS.rglob("*") if path.is_dir() and path.name != "__pycache__"
               and any(path.glob("test_*.py"))]
    assert folders
    assert {str(folder.relative_to(TESTS)): _package_of(folder) for folder in folders if _package_of(folder) is None} == {}


def test_a_folder_named_after_no_package_is_found() -> None:
    assert _package_of(TESTS / "serving_worker") is None
    assert _package_of(TESTS / "engine" / "server") == "serving.engine.server"
