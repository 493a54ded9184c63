"""The shape of our imports: no cycles, the runtime never imports the tooling, and the API
process (server.app) loads no torch (it validates, tokenizes and streams; the engine process
runs the model)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.import_graph import REPO, cycles, graph, imports_of, modules


def test_no_import_cycles_even_through_deferred_or_type_only_imports():
    assert cycles(graph(include_deferred=True)) == []


def test_the_runtime_never_imports_the_tooling():
    mods = modules()
    offending = [
        f"{name}:{line} imports {target}"
        for name, path in mods.items()
        if name.split(".")[0] in ("engine", "server")
        for target, line, _ in imports_of(path, set(mods))
        if target.split(".")[0] == "tooling"
    ]
    assert offending == []


def test_the_tooling_reaches_the_engine_only_through_its_public_surface():
    # `engine` (the offline API) and `engine.toolkit` (the names the tooling may use, each
    # group with its reason): the rest of the engine may change without a look at tooling/.
    mods = modules()
    offending = [
        f"{name}:{line} imports {target}"
        for name, path in mods.items()
        if name.split(".")[0] == "tooling"
        for target, line, _ in imports_of(path, set(mods))
        if target.split(".")[0] == "engine" and target not in ("engine", "engine.toolkit")
    ]
    assert offending == []


def test_every_toolkit_name_resolves_to_the_engines_own():
    import engine.toolkit
    from engine.toolkit import EXPORTS

    assert len(EXPORTS) > 30
    for name, module in EXPORTS.items():
        assert getattr(engine.toolkit, name) is not None, name
        assert module in modules(), module  # the table names real modules (the graph sees them)
    from engine.decoders.public_drafters import export

    assert engine.toolkit.export_drafter is export
    with pytest.raises(AttributeError, match="no attribute 'Scheduler'"):
        engine.toolkit.Scheduler  # noqa: B018


def test_the_cycle_finder_finds_a_cycle():
    # So that the first test cannot pass for want of a working finder.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _loads_torch(statement: str) -> bool:
    code = f"import sys; {statement}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "True"


def test_the_api_process_imports_no_torch():
    assert not _loads_torch("import server.app")
    assert not _loads_torch("import server.cli; server.cli.build_parser()")
    # specserve --help (the tooling's commands included) stays instant.
    assert not _loads_torch("import tooling.cli; tooling.cli.build_parser()")


def test_the_check_itself_sees_torch_where_it_is():
    assert _loads_torch("import engine.sampling")


def _deferred_imports_without_a_reason(source: str) -> list[int]:
    """Lines of imports inside functions with no comment saying why: on the line, on the line
    above, or above the run of imports (blank lines between) it belongs to."""
    import ast

    lines = source.splitlines()
    missing = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            above = node.lineno - 2  # index of the line above
            run = ("import ", "from ")
            while above >= 0 and (not lines[above].strip() or lines[above].strip().startswith(run)):
                above -= 1
            said = "#" in lines[node.lineno - 1] or lines[above].lstrip().startswith(("#", "try:"))
            if not said:
                missing.append(node.lineno)
    return sorted(set(missing))


def test_every_deferred_import_says_why():
    """Imports inside functions only where a heavy or optional dependency loads lazily, each
    with its reason in a line (the rest sit at the top, where cycles and costs show)."""
    offending = [
        f"{path.relative_to(REPO)}:{line}"
        for name, path in modules().items()
        if name.split(".")[0] in ("engine", "server")
        for line in _deferred_imports_without_a_reason(path.read_text())
    ]
    assert offending == []


def test_the_reason_finder_sees_a_bare_deferred_import():
    source = (
        "def f():\n    # torch: heavy\n    import torch\n    import json\n\n"
        "def g():\n    import os\n"
    )
    assert _deferred_imports_without_a_reason(source) == [7]
