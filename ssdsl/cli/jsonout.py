"""The ``--json`` documents of every command: one envelope, one version (docs/json.md)."""

from __future__ import annotations

import json
import sys
from typing import Any

from ssdsl.schema import SCHEMA_VERSION


def document(command: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` under the envelope every command shares: ``schema_version`` and ``command``
    first, then ``ok`` (true unless the body says otherwise), then the command's own fields."""
    return {"schema_version": SCHEMA_VERSION, "command": command, "ok": body.pop("ok", True),
            **body}


def emit(command: str, body: dict[str, Any]) -> None:
    """Print ``document(command, body)`` on stdout."""
    json.dump(document(command, body), sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")
