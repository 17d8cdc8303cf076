"""The docs cannot drift: every command in a ```bash block of README.md and docs/tutorial.md
runs (from a scratch directory that sees the checkout's examples/), the output shown after it in
a ```text block is what it prints (step and loss, MATCH), and the tutorial's plans are the files
in examples/tutorial/.

Oracle: the commands' real output, and the plan files themselves. `pip install` lines are not
run (they change the environment); they are checked to name torch's CPU wheel index and the
package.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "tutorial.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(path: Path) -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in FENCE.findall(path.read_text())]


def commands() -> list[tuple[str, str, str | None]]:
    """(doc, command, the text block shown after its bash block or None)."""
    out = []
    for doc in DOCS:
        bs = blocks(doc)
        for i, (lang, body) in enumerate(bs):
            if lang != "bash":
                continue
            shown = bs[i + 1][1] if i + 1 < len(bs) and bs[i + 1][0] == "text" else None
            lines = [x.strip() for x in body.splitlines() if x.strip() and not x.startswith("#")]
            for k, line in enumerate(lines):
                # a chain (`pip install . && ssdsl run ...`) is its commands, in order
                parts = [p.strip() for p in line.split("&&")]
                for j, part in enumerate(parts):
                    last = k == len(lines) - 1 and j == len(parts) - 1
                    out.append((doc.name, part, shown if last else None))
    return out


def _runnable(command: str) -> bool:
    """Not run here: installs (they change the environment) and the test command itself."""
    return not command.startswith("pip ") and command != TEST_COMMAND


CASES = commands()
# the README's test command is the one CI runs (the last line of .ci/run)
TEST_COMMAND = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]


def test_the_docs_have_commands():
    runnable = [c for _, c, _ in CASES if _runnable(c)]
    assert len(runnable) >= 10
    assert any("three_d.ssp" in c for c in runnable) and any("torchrun" in c for c in runnable)


def test_install_lines_say_how_to_get_torch():
    readme = (ROOT / "README.md").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme  # CPU only
    assert "pytorch.org/get-started" in readme  # GPU users: torch's own instructions
    assert [c for _, c, _ in CASES if c.startswith("pip ")] == ["pip install .",
                                                                 "pip install '.[test]'"]


def test_the_quick_start_is_two_commands_and_the_second_is_ci():
    """One installs and runs the main job on a bundled example; one installs what the tests need
    and runs them, with exactly CI's test command."""
    first, second = [body.strip() for lang, body in blocks(ROOT / "README.md")
                     if lang == "bash"][:2]
    assert first.startswith("pip install . && ssdsl run examples/") and "\n" not in first
    assert second == f"pip install '.[test]' && {TEST_COMMAND}"


def test_tutorial_plans_are_the_files():
    shown = [body for lang, body in blocks(ROOT / "docs" / "tutorial.md") if lang == "ssp"]
    files = sorted((ROOT / "examples" / "tutorial").glob("*.ssp"))
    assert sorted(shown) == sorted(f.read_text() for f in files)
    assert len(files) == 5


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    if words[0] == "ssdsl":
        return [sys.executable, "-m", "ssdsl", *words[1:]]
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    raise AssertionError(f"a docs command this test does not know how to run: {command}")


@pytest.mark.slow
@pytest.mark.parametrize("doc, command, shown", [c for c in CASES if _runnable(c[1])],
                         ids=[f"{d}:{c[:60]}" for d, c, _ in CASES if _runnable(c)])
def test_command_runs_and_prints_what_the_doc_shows(doc, command, shown, tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(_argv(command), cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if shown is None:
        return
    out = proc.stdout.splitlines()
    for line in shown.splitlines():
        head = line.split("...")[0].strip()
        if head.startswith("step "):
            assert any(o.startswith(head) for o in out), f"{doc} shows {head!r}:\n{proc.stdout}"
        elif head:
            assert any(o.strip().startswith(head) for o in out), \
                f"{doc} shows {head!r}:\n{proc.stdout}"


def test_pipelines_page_quotes_the_readme_figures():
    """docs/pipelines.md carries no measurements of its own (the issue found them disagreeing
    with the README's): every ratio it quotes is one in the README's Results table."""
    quoted = re.findall(r"\b(\d\.\d\d)\b", (ROOT / "docs" / "pipelines.md").read_text()
                        .split("## Measured")[1])
    results = (ROOT / "README.md").read_text().split("## Results")[1]
    assert quoted and all(q in results for q in quoted), quoted
    assert "ms/step" not in (ROOT / "docs" / "pipelines.md").read_text().split("## Measured")[1]
