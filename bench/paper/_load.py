"""Load an example model file as a module whose size constants the paper-scale files override."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"


def example(name: str, **sizes: object) -> ModuleType:
    """``examples/<name>.py`` loaded afresh, with the module constants in ``sizes`` replaced."""
    spec = importlib.util.spec_from_file_location(f"ssdsl_paper_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for key, value in sizes.items():
        setattr(module, key, value)
    return module
