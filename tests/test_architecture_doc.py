"""Docs that a test keeps true: ARCHITECTURE.md's module table and README.md's tables.

* Each module's imports (of the package's other modules, of torch, of SGLang), read
  from its source with ``ast`` (imports inside functions too), are in the "may import"
  column of its row in ARCHITECTURE.md's "Modules and what each may touch"; every
  module has a row, every row and every module named in a row exists. The ``bench/``
  package is one row; ``__init__.py`` and ``_version.py`` have their own.
* A row whose job says "Pure Python" imports neither torch nor SGLang, nor a module
  that does.
* README.md's metrics table lists every series of ``metric_names`` and no other;
  its flags table lists every flag and environment variable of ``config``, with the
  defaults ``config`` defines.

Pure Python: no SGLang, no torch.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from sglang_dynspec import config, metric_names, step_timing

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sglang_dynspec"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
README = ROOT / "README.md"
TABLE_HEADING = "## Modules and what each may touch"
# The words of the "may import" column besides the package's modules in backticks.
SGLANG, TORCH, NOTHING = "SGLang", "torch", "nothing"
HOST_PACKAGES = {"sglang": SGLANG, "sgl_kernel": SGLANG, "torch": TORCH}
PURE = "Pure Python"


# ------------------------------------------------------------------ the code's imports
def package_modules() -> dict[str, list[Path]]:
    """Module name -> its source files: one per ``*.py``, all of ``bench/`` for ``bench``."""
    modules = {path.stem: [path] for path in sorted(PACKAGE.glob("*.py"))}
    for package in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()):
        modules[package.name] = sorted(package.rglob("*.py"))
    return modules


def imports_of(module: str, sources: list[str], modules: set[str]) -> set[str]:
    """What ``module`` imports: the package's other modules by name, and SGLANG / TORCH.
    Relative imports stay inside a subpackage (``bench``); other libraries are not counted."""
    found = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # ``from sglang_dynspec import config``: the names may be modules.
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                top, *rest = name.split(".")
                if top in HOST_PACKAGES:
                    found.add(HOST_PACKAGES[top])
                elif top == "sglang_dynspec":
                    found.add(rest[0] if rest and rest[0] in modules else "__init__")
    return found - {module}


def actual_imports() -> dict[str, set[str]]:
    modules = package_modules()
    return {
        name: imports_of(name, [p.read_text() for p in paths], set(modules))
        for name, paths in modules.items()
    }


# ------------------------------------------------------------------ the document's table
def table_rows(markdown: str, heading: str) -> list[list[str]]:
    """The cells of the first table after ``heading`` (header and separator dropped)."""
    lines = markdown.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def module_of(cell: str) -> str:
    """```plugin.py``` -> plugin, ```bench/``` -> bench."""
    match = re.fullmatch(r"`([\w/.]+)`", cell)
    assert match, f"the module column must hold one name in backticks, got {cell!r}"
    return match.group(1).removesuffix(".py").removesuffix("/")


def allowed_imports(cell: str) -> set[str]:
    """The "may import" cell: modules in backticks, SGLang, torch, or nothing; remarks in
    parentheses are skipped."""
    items = [item.strip() for item in re.sub(r"\([^)]*\)", "", cell).split(",")]
    allowed = set()
    for item in items:
        if item in (SGLANG, TORCH):
            allowed.add(item)
        elif re.fullmatch(r"`\w+`", item):
            allowed.add(item.strip("`"))
        elif item == NOTHING and len(items) == 1:
            pass
        else:
            raise AssertionError(
                f"{item!r} in the may-import cell {cell!r}: write modules in backticks, "
                f"{SGLANG}, {TORCH}, or {NOTHING} alone (remarks in parentheses)"
            )
    return allowed


def documented(markdown: str) -> dict[str, tuple[str, set[str]]]:
    """Module -> (its job, what it may import), from ARCHITECTURE.md."""
    table = {}
    for row in table_rows(markdown, TABLE_HEADING):
        assert len(row) == 3, f"a row of three cells (module, job, may import), got {row}"
        name = module_of(row[0])
        assert name not in table, f"two rows for {name}"
        table[name] = (row[1], allowed_imports(row[2]))
    return table


def disagreements(actual: dict[str, set[str]], table: dict[str, tuple[str, set[str]]]) -> list[str]:
    problems = [f"{m}: no row in the table" for m in sorted(set(actual) - set(table))]
    problems += [f"{m}: a row for a module that does not exist" for m in sorted(set(table) - set(actual))]
    for name, (_, allowed) in sorted(table.items()):
        unknown = allowed - set(actual) - {SGLANG, TORCH}
        problems += [f"{name}: may import {u}, which does not exist" for u in sorted(unknown)]
        if name in actual:
            problems += [f"{name} imports {i}, not in its row" for i in sorted(actual[name] - allowed)]
    return problems


def impure(actual: dict[str, set[str]], table: dict[str, tuple[str, set[str]]]) -> list[str]:
    """Rows that say "Pure Python" but reach torch or SGLang, directly or through a module."""
    problems = []
    for name, (job, _) in sorted(table.items()):
        if PURE not in job or name not in actual:
            continue
        seen, todo = set(), [name]
        while todo:
            for imported in actual.get(todo.pop(), ()):
                if imported not in seen:
                    seen.add(imported)
                    todo.append(imported)
        problems += [f"{name} says {PURE!r} and reaches {h}" for h in sorted(seen & {SGLANG, TORCH})]
    return problems


def test_every_module_imports_only_what_its_row_allows():
    table = documented(ARCHITECTURE.read_text())
    assert disagreements(actual_imports(), table) == []


def test_pure_python_modules_reach_neither_torch_nor_sglang():
    table = documented(ARCHITECTURE.read_text())
    assert [name for name, (job, _) in table.items() if PURE in job], "no row says Pure Python"
    assert impure(actual_imports(), table) == []


def test_the_check_catches_a_wrong_table():
    """Negative controls: each kind of drift is reported."""
    text = ARCHITECTURE.read_text()
    actual = actual_imports()
    table = documented(text)

    narrower = dict(table, config=(table["config"][0], {"policy"}))
    assert disagreements(actual, narrower) == ["config imports goodput, not in its row"]

    with_new_module = {**actual, "new_module": {"compat"}}
    assert disagreements(with_new_module, table) == ["new_module: no row in the table"]

    row = "| `spec_class.py` |"
    stale = text.replace(row, "| `gone.py` | a module since removed | `compat` |\n" + row)
    assert disagreements(actual, documented(stale)) == ["gone: a row for a module that does not exist"]

    tainted = {**actual, "policy": {TORCH}}
    assert "policy says 'Pure Python' and reaches torch" in impure(tainted, table)
    assert "goodput says 'Pure Python' and reaches torch" in impure(tainted, table)


@pytest.mark.parametrize("cell", ["everything below", "`compat`, the rest", "nothing, `policy`"])
def test_the_may_import_vocabulary_is_closed(cell):
    with pytest.raises(AssertionError, match="may-import cell"):
        allowed_imports(cell)


# ------------------------------------------------------------------ README.md
def _series() -> set[str]:
    """Every exported series of ``metric_names``: counters with ``_total``."""
    series = set()
    for name, value in vars(metric_names).items():
        if isinstance(value, str) and value.startswith("sglang:"):
            series.add(metric_names.total(value) if name.endswith("_COUNTER") else value)
    return series


def test_readme_metrics_table_lists_every_metric():
    rows = table_rows(README.read_text(), "### Metrics")
    listed = {
        re.sub(r"\{.*\}$", "", name) for row in rows for name in re.findall(r"`(sglang:[^`]+)`", row[0])
    }
    assert listed == _series()


def test_readme_flags_table_lists_every_flag_with_its_default():
    rows = table_rows(README.read_text(), "### Flags")
    by_env = {row[1].strip("`"): row for row in rows}
    envs = [flag.env for flag in config.FLAGS] + [
        config.FLUSH_TOKENS_ENV,
        config.EAGER_DRAFT_TOKENS_ENV,
        config.FLUSH_STREAM_ENV,
        config.SPLIT_KV_VERIFY_ENV,
        config.GROUPED_VERIFY_ENV,
        config.SPLITS_BY_BATCH_ENV,
        config.SPLIT_KV_DRAFT_EXTEND_ENV,
        config.LAST_ACCEPTED_LOGITS_ENV,
        config.PLAIN_CUDA_GRAPH_ENV,
        config.REQUEST_MODES_ENV,
        config.COST_CACHE_ENV,
        step_timing.CALIBRATE_ENV,
        step_timing.BUDGET_ENV,
    ]
    assert sorted(by_env) == sorted(envs)
    for flag in config.FLAGS:
        assert by_env[flag.env][0].startswith(f"`{flag.option} "), by_env[flag.env]
    defaults = {
        config.POLICY: f"`{config.DEFAULT_POLICY}`",
        config.DISABLE_THRESHOLD: str(config.DEFAULT_DISABLE_ABOVE),
        config.ENABLE_THRESHOLD: f"({config.default_enable_at_or_below(config.DEFAULT_DISABLE_ABOVE)})",
        config.MIN_DWELL: str(config.DEFAULT_MIN_DWELL_STEPS),
        config.CATCH_UP_TOKENS: str(config.DEFAULT_CATCH_UP_TOKENS),
        config.PENALTIES: f"`{config.DEFAULT_PENALTIES}`",
    }
    for flag, default in defaults.items():
        assert by_env[flag.env][2].endswith(default), (by_env[flag.env][2], default)
    assert f"0 ≤ T ≤ {config.MAX_CATCH_UP_TOKENS}" in by_env[config.CATCH_UP_TOKENS.env][3]
