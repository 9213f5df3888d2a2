"""The import graph runs one way: top -> kernels -> proxy/memory/status/pacing -> world ->
device code -> jit -> base. A module may import its own layer or lower ones, never higher,
at module level or inside a function (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "mkrt"

# (prefix, layer); the longest matching prefix wins.
LAYERS = [
    ("mkrt.envs", 0), ("mkrt.errors", 0), ("mkrt.arrays", 0), ("mkrt.launch", 0), ("mkrt.checks", 0),
    ("mkrt.bench", 0), ("mkrt.cuda", 0),
    ("mkrt.jit", 1),
    ("mkrt.kernels.device", 2), ("mkrt.proxy.layout", 2),   # CUDA vocabulary + wire format
    ("mkrt.world", 3),
    ("mkrt.memory", 4), ("mkrt.status", 4), ("mkrt.pacing", 4), ("mkrt.proxy", 4),
    ("mkrt.kernels", 5), ("mkrt.controller", 5),
    ("mkrt.report", 6), ("mkrt.__main__", 6), ("mkrt", 6),
]
NAMES = ["base", "jit", "device code", "world", "proxy/memory/status/pacing", "kernels/controller", "top"]


def layer(module: str) -> int:
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return dict(LAYERS)[best]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, module: str) -> set[str]:
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mkrt")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if not base.startswith("mkrt"):
                continue
            for alias in node.names:      # `from mkrt.x import y` may name a module y
                candidate = f"{base}.{alias.name}"
                has_module = (ROOT.parent / Path(*candidate.split("."))).with_suffix(".py").exists() \
                    or (ROOT.parent / Path(*candidate.split("."))).is_dir()
                found.add(candidate if has_module else base)
    return found


def test_no_upward_imports():
    problems = []
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        for target in imports(path, module):
            if target == "mkrt" and layer(module) < layer("mkrt"):
                problems.append(f"{module} imports the top-level package")
            elif layer(target) > layer(module):
                problems.append(f"{module} ({NAMES[layer(module)]}) imports {target} "
                                f"({NAMES[layer(target)]})")
    assert not problems, "\n".join(problems)


def test_layer_table_covers_every_module():
    for path in ROOT.rglob("*.py"):
        layer(module_name(path))      # raises ValueError (max of nothing) when uncovered
