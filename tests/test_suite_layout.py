"""The test suite helps itself: test modules and conftests import only the product and
tests.support (never a test module, a conftest or another helper among the tests), and the
private Redis fixture is defined once, in tests/support."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported(path: Path, root: Path) -> list[str]:
    """The modules `path` (a file under `root`, the tests folder) imports from; relative imports
    resolved against its package."""
    package = ".".join(path.relative_to(root.parent).parent.parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            # `from tests import x` names a module x as much as `import tests.x` does
            found += [f"{module}.{alias.name}" for alias in node.names] \
                if module in {"tests", "tests.support"} else [module]
        elif isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "pytest_plugins"
                                                  for target in node.targets):
            found += [item.value for item in ast.walk(node.value)
                      if isinstance(item, ast.Constant) and isinstance(item.value, str)]
    return found


def _reaches_into_the_tests(module: str) -> bool:
    """Whether `module` is under tests/ and not tests.support (or one of its modules)."""
    parts = module.split(".")
    if parts[0] != "tests":
        return False
    return parts[:2] != ["tests", "support"]


def layout_problems(root: Path = TESTS) -> list[str]:
    """Each file under `root` that breaks the layout, with what it does."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root.parent)
        wrong = sorted({module for module in _imported(path, root)
                        if _reaches_into_the_tests(module)})
        if wrong:
            problems.append(f"{relative} imports {', '.join(wrong)}: "
                            "move what it shares into tests/support")
        in_support = root / "support" in path.parents
        tree = ast.parse(path.read_text(), str(path))
        if not in_support and any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                                  and node.name == "private_redis" for node in ast.walk(tree)):
            problems.append(f"{relative} defines private_redis: use tests/support/redis.py's")
    return problems


def test_test_modules_import_only_the_product_and_tests_support():
    assert layout_problems() == []


def test_the_layout_check_names_a_file_that_imports_a_test_module(tmp_path):
    tests = tmp_path / "tests"
    (tests / "support").mkdir(parents=True)
    (tests / "telemetry").mkdir()
    (tests / "support" / "batches.py").write_text("import json\n")
    (tests / "telemetry" / "test_ingest.py").write_text(
        "from tests.support.batches import telemetry_batch\n")
    (tests / "telemetry" / "test_replay.py").write_text(
        "from tests.telemetry.test_ingest import helper\n")
    (tests / "telemetry" / "test_relative.py").write_text("from .test_ingest import helper\n")
    (tests / "telemetry" / "test_conftest.py").write_text("from tests.conftest import fixture\n")
    (tests / "telemetry" / "test_package.py").write_text("from tests.telemetry import helpers\n")
    (tests / "telemetry" / "conftest.py").write_text(
        'pytest_plugins = ["tests.support.batches", "tests.telemetry.test_ingest"]\n')
    (tests / "telemetry" / "test_redis.py").write_text("def private_redis():\n    pass\n")
    (tests / "support" / "redis.py").write_text("def private_redis():\n    pass\n")
    problems = layout_problems(tests)
    assert [problem.split(" ", 1)[0] for problem in problems] == [
        "tests/telemetry/conftest.py", "tests/telemetry/test_conftest.py",
        "tests/telemetry/test_package.py", "tests/telemetry/test_redis.py",
        "tests/telemetry/test_relative.py", "tests/telemetry/test_replay.py"]
    assert "imports tests.telemetry.test_ingest" in problems[-1]
    assert "defines private_redis" in problems[3]
