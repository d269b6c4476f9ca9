"""The code's shape rules, checked on every run: ``ruff check`` passes (its settings are in
pyproject.toml), no function is longer than 80 lines and no package file longer than 400, except
where a ``# long: <why>`` comment on the line above the ``def`` (or on the file's first line)
says why."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_pp"
MAX_FUNCTION, MAX_FILE = 80, 400


def _long_functions(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    found = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - node.lineno + 1
            excused = first >= 2 and "# long:" in lines[first - 2]
            if length > MAX_FUNCTION and not excused:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_functions_and_files_stay_short():
    long_functions, long_files = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        long_functions += _long_functions(path)
        if text.count("\n") > MAX_FILE and "# long:" not in text.splitlines()[0]:
            long_files.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not long_functions, f"functions over {MAX_FUNCTION} lines: {long_functions}; split them"
    assert not long_files, f"package files over {MAX_FILE} lines: {long_files}; split them"


def test_ruff_passes():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the test extra: pip install -e .[test])")
    result = subprocess.run([ruff, "check", "--no-cache", str(ROOT)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


OVERRIDES_CHECKED = ("lightning_pp.strategies.trainer", "lightning_pp.strategies.fabric", "lightning_pp.strategies.core",
                     "lightning_pp.callbacks.monitor")


def test_every_override_of_lightning_is_marked():
    """Lightning's idiom: a method that overrides a base class's carries ``@override`` (so a rename
    in Lightning is caught by a type checker instead of silently adding a method)."""
    import ast
    import importlib

    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.pytorch.strategies import DDPStrategy as TrainerDDP

    unmarked = []
    for name in OVERRIDES_CHECKED:
        module = importlib.import_module(name)
        tree = ast.parse(Path(module.__file__).read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            klass = getattr(module, cls.name, None)
            if klass is None:
                continue
            bases = [TrainerDDP, FabricDDP] if cls.name == "PipelineStrategyMixin" else list(klass.__mro__[1:])
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                decorators = [ast.unparse(d) for d in fn.decorator_list]
                if fn.name.startswith("__") or any(d.endswith(".setter") for d in decorators):
                    continue
                overrides = any(fn.name in vars(b) for base in bases for b in base.__mro__ if b is not object)
                if overrides and "override" not in decorators:
                    unmarked.append(f"{name}.{cls.name}.{fn.name}")
    assert unmarked == []
