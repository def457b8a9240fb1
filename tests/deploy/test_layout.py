"""The layout's promises, checked on the source: no import cycles, dependencies pointing one way,
and a proxy that starts without simulator, plotting or progress-bar code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("controller", "policies", "simulator")
LIVE_ROOMS = ("controller.proxy", "controller.picker", "controller.bench")
"""The live side's rooms below the command line."""


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """Project modules `path` imports anywhere (function bodies and TYPE_CHECKING blocks too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    # A package's own __init__ is imported with any of its modules: not an edge worth a cycle.
    return {
        m: {d for d in _imports(p, known) if d != m and not m.startswith(d + ".")} for m, p in modules.items()
    }


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d) :], d])
            elif d not in state:
                visit(d, [*stack, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_dependencies_point_one_way() -> None:
    graph = _graph()
    bad = []
    for m, deps in graph.items():
        for d in deps:
            top, dtop = m.split(".")[0], d.split(".")[0]
            if top == "policies" and dtop != "policies":
                bad.append(f"{m} -> {d} (policies imports only policies)")
            if top == "simulator" and dtop == "controller":
                bad.append(f"{m} -> {d} (the simulator never imports the controller)")
            if m.startswith(LIVE_ROOMS) and dtop == "simulator":
                bad.append(f"{m} -> {d} (only the command line reaches the simulator)")
            if m.startswith(LIVE_ROOMS) and d.startswith("controller.cli"):
                bad.append(f"{m} -> {d} (the command line is on top, nothing imports it)")
    assert not bad, "\n".join(sorted(bad))


def test_serve_loads_no_simulator_plotting_or_progress_bars() -> None:
    code = (
        "import sys\n"
        "from controller.cli import build_parser\n"
        "from controller.cli.serve import _build\n"
        "args = build_parser('serve').parse_args(['serve', '--baseline', 'http://127.0.0.1:9', "
        "'--eagle', 'http://127.0.0.1:10', '--policy', 'cost_model', '--profile', 'kimi-k25-int4-8gpu'])\n"
        "settings, registry, context, policy = _build(args)\n"
        "from controller.proxy.app import create_app\n"
        "create_app(settings, policy, registry=registry, context=context)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('simulator', 'tqdm', 'matplotlib'))\n"
        "print(' '.join(heavy))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert proc.stdout.strip() == "", f"serve imported: {proc.stdout}"
