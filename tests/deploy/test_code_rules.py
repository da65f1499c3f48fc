"""Rules over the source that neither ruff nor mypy states.

`contextlib.suppress(Exception)` (or BaseException) swallows every error unlogged: a
fault the fault tests look for would then leave no trace. ruff's BLE001 asks the same of
`except Exception:` clauses (log or re-raise); no ruff rule sees a suppress() call.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BROAD = {"Exception", "BaseException"}


def _python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    return [REPO / f for f in listed if not (REPO / f).is_symlink() and (REPO / f).is_file()]


def _is_suppress(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "suppress") or (isinstance(f, ast.Name) and f.id == "suppress")


def broad_suppressions(source: str) -> list[int]:
    """Lines of `suppress(...)` calls that name Exception or BaseException."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _is_suppress(node):
            names = {a.id if isinstance(a, ast.Name) else getattr(a, "attr", "") for a in node.args}
            if names & BROAD:
                lines.append(node.lineno)
    return lines


def test_the_rule_sees_a_broad_suppress() -> None:
    src = ("import contextlib\nfrom contextlib import suppress\n"
           "with contextlib.suppress(Exception):\n    pass\n"
           "with suppress(ValueError, BaseException):\n    pass\n"
           "with contextlib.suppress(ValueError):\n    pass\n")
    assert broad_suppressions(src) == [3, 5]


def test_no_error_is_swallowed_unlogged() -> None:
    found = [f"{path.relative_to(REPO)}:{line}" for path in _python_files()
             for line in broad_suppressions(path.read_text())]
    assert not found, f"suppress(Exception) hides errors unlogged; catch what is meant and log it: {found}"
