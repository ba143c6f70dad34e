"""Import layering: the trainers (hsched.rl), the environments (hsched.envs) and the policies never import an
evaluation report (hsched.eval), not even inside a function, so a report can import what it evaluates without
an import circle. Checked on the source, every import statement."""

from __future__ import annotations

import ast
from pathlib import Path

import hsched

SRC = Path(hsched.__file__).parent


def imported_modules(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def test_imported_modules_sees_imports_inside_functions(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import os\n\ndef g():\n    from hsched.eval import gpu\n    import hsched.eval.dag\n")
    assert {"os", "hsched.eval", "hsched.eval.gpu", "hsched.eval.dag"} <= imported_modules(f)


def test_trainers_envs_and_policies_never_import_evaluation_reports() -> None:
    offenders = {
        f"{path.relative_to(SRC)}: {module}"
        for package in ("rl", "envs", "policies")
        for path in sorted((SRC / package).glob("*.py"))
        for module in imported_modules(path)
        if module == "hsched.eval" or module.startswith("hsched.eval.")
    }
    assert not offenders, sorted(offenders)
