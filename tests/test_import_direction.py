"""Imports run down the layers, never up or across (DESIGN §6), read from every module's source with `ast`
(nothing is imported, so a module that needs a GPU or a missing package is checked too).

    proto, kvroute (the bottom) ──► kvkernels ──► worker
                   kvroute ──────────────────► gateway
    sim, loadtest, launch, benchmarks, exercises, deploy above them all
    gateway/: request, errors, worker_spec, worker_client ──► routing, admission, tracing, metrics ──► fleet
              ──► forwarding ──► request_stream ──► request_path ──► pools ──► frontdoors ──► responses
              ──► cli_gateway, cli_epp

`MAY_IMPORT` is the one table: a row per package (a top-level folder, a room inside one such as
"gateway/routing", or one module such as "launch/cli") and the packages it may import besides itself. A module
belongs to the longest row that holds it, and so does each module it imports; an import is allowed within one
row, or to a row named in the importer's (naming a package allows its rooms: "gateway" allows
"gateway/routing"). Add a folder, or split one into rooms, here and nowhere else.

Every `import` and `from ... import` counts, under `if TYPE_CHECKING:` and inside functions too. A module that
imports by name (`importlib.import_module`, `__import__`) is taken to import every module of this repository
that one of its string constants names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_DOTTED = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+")  # a module named by a string: "sim.doctor"
NOT_CHECKED = {"tests"}  # the tests import every layer they test
_BOTTOM = {"proto", "kvroute"}
_ENGINE = _BOTTOM | {"kvkernels", "worker"}
_SERVING = _ENGINE | {"gateway"}

_GATEWAY_GROUND = {"gateway/request", "gateway/errors", "gateway/worker_spec", "gateway/worker_client"}
_GATEWAY_BELOW_PATH = _GATEWAY_GROUND | {
    "gateway/routing",
    "gateway/admission",
    "gateway/metrics",
    "gateway/tracing",
    "gateway/fleet",
    "gateway/forwarding",
    "gateway/flow_control",
    "gateway/tool_calls",
    "gateway/structured_request",
}

MAY_IMPORT: dict[str, set[str]] = {
    "proto": set(),  # generated from proto/*.proto
    "kvroute": {"proto"},  # hashing, tokenizer, chat template, wire formats: shared by every layer
    "kvkernels": {"kvroute"},
    "worker": {"kvroute", "kvkernels", "proto"},
    # the gateway's rooms, bottom to top; it never imports the worker: it speaks to workers over the wire only
    "gateway": {"kvroute", "proto"},
    **{ground: {"kvroute", "proto"} | _GATEWAY_GROUND for ground in _GATEWAY_GROUND},
    "gateway/routing": {"kvroute", "proto"} | _GATEWAY_GROUND,  # policies, ring, KV index, the view they read
    "gateway/admission": {"kvroute", "proto"} | _GATEWAY_GROUND,  # API keys, tenants, limits
    "gateway/tracing": {"kvroute", "proto"} | _GATEWAY_GROUND,
    "gateway/tool_calls": {"kvroute", "proto"} | _GATEWAY_GROUND,  # tool calls read back out of a model's text
    # a request's tools, tool_choice and response_format: checked, and the constraint a worker decodes under
    "gateway/structured_request": {"kvroute", "proto"} | _GATEWAY_GROUND,
    "gateway/metrics": {"kvroute", "proto", "gateway/routing", "gateway/admission"} | _GATEWAY_GROUND,
    "gateway/fleet": {"kvroute", "proto", "gateway/routing", "gateway/metrics"} | _GATEWAY_GROUND,  # fleet states
    "gateway/forwarding": {"kvroute", "proto", "gateway/fleet", "gateway/routing", "gateway/metrics"}
    | _GATEWAY_GROUND,  # backends, retries and deadlines, detokenizing
    # the queue, saturation and the stage before the pick
    "gateway/flow_control": {"kvroute", "proto", "gateway/routing", "gateway/metrics"} | _GATEWAY_GROUND,
    "gateway/request_stream": {"kvroute", "proto"} | _GATEWAY_BELOW_PATH,  # a started request's streams
    "gateway/request_path": {"kvroute", "proto", "gateway/request_stream"} | _GATEWAY_BELOW_PATH,
    "gateway/pools": {"kvroute", "proto", "gateway/request_path"} | _GATEWAY_BELOW_PATH,
    "gateway/frontdoors": {"kvroute", "proto", "gateway/request_path", "gateway/pools"} | _GATEWAY_BELOW_PATH,
    # the Responses API: its routes (on the HTTP front door's helpers), its store and its renderer
    "gateway/responses": {"kvroute", "proto", "gateway/request_path", "gateway/pools", "gateway/frontdoors"}
    | _GATEWAY_BELOW_PATH,
    "gateway/cli_gateway": {"kvroute", "proto", "gateway"},  # builds and serves it all
    "gateway/cli_epp": {"kvroute", "proto", "gateway"},
    "sim": _SERVING,  # the simulator runs the real engine and the real router
    "loadtest": _SERVING | {"sim", "launch"},  # the bench starts its fleets with the launcher
    "launch": _SERVING | {"sim"},  # the fleet launcher, `kvroute up`, `kvroute worker`
    "quality": _ENGINE,  # `kvroute quality`: engines of two configurations side by side
    # the command line: every subcommand
    "launch/cli": _SERVING | {"sim", "loadtest", "launch", "benchmarks", "quality"},
    "benchmarks": _SERVING | {"sim", "loadtest", "launch", "quality"},  # micro-benchmarks, each against a baseline
    "exercises": _SERVING | {"sim", "loadtest", "launch"},
    "deploy": set(),  # the images' health check runs on the standard library alone
}
# Imports allowed against the table, each by file and the packages it may import besides its row's.
EXCEPTIONS: dict[str, set[str]] = {}


def row_of(path: str) -> str | None:
    """The table's row for a file or module path ("gateway/routing/router.py", "gateway/routing/router"), or
    None."""
    parts = path.removesuffix(".py").split("/")
    for n in range(len(parts), 0, -1):
        if "/".join(parts[:n]) in MAY_IMPORT:
            return "/".join(parts[:n])
    return None


def allowed(importer: str, target: str) -> bool:
    if target == importer:
        return True
    return any(target == name or target.startswith(name + "/") for name in MAY_IMPORT[importer])


def source_files(root: Path) -> list[Path]:
    """Every .py file of the repository outside the tests and hidden folders."""
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] not in NOT_CHECKED and not any(p.startswith(".") for p in parts):
            files.append(path)
    return files


def imports(path: Path, root: Path, ours: set[str]) -> list[tuple[int, str, str]]:
    """(line, module as written, module as a path) of every import of this repository's modules in `path`;
    `from a import b` is a/b as a path, since b may be a module (the longer path finds the longer row)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(root).parts[:-1])
    found: list[tuple[int, str, str]] = []
    by_name = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, alias.name.replace(".", "/")) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the importer's package, `level - 1` folders up
                base = package[: len(package) - (node.level - 1)]
                parts = base + (node.module.split(".") if node.module else [])
            else:
                parts = (node.module or "").split(".")
            shown = ".".join(parts)
            found += [(node.lineno, shown or alias.name, "/".join([*parts, alias.name])) for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            by_name |= name in ("import_module", "__import__")
    if by_name:
        found += [
            (node.lineno, node.value, node.value.replace(".", "/"))
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.fullmatch(node.value)
        ]
    return [(line, shown, module) for line, shown, module in found if module.split("/")[0] in ours]


def offences(root: Path = ROOT) -> list[str]:
    """One line per import against the table: "file:line: row imports module (its row)"."""
    files = source_files(root)
    ours = {f.relative_to(root).parts[0] for f in files if len(f.relative_to(root).parts) > 1}
    ours |= {name.split("/")[0] for name in MAY_IMPORT}
    found = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        importer = row_of(rel)
        if importer is None:
            found.append(f"{rel}: its folder has no row in MAY_IMPORT (tests/test_import_direction.py)")
            continue
        for line, shown, module in imports(path, root, ours):
            target = row_of(module)
            if target is None or allowed(importer, target) or target.split("/")[0] in EXCEPTIONS.get(rel, ()):
                continue
            found.append(f"{rel}:{line}: {importer} imports {shown} ({target})")
    return found


def test_every_import_runs_down_the_table():
    found = offences()
    assert not found, "imports against MAY_IMPORT:\n" + "\n".join(found)


def test_the_table_keeps_the_serving_layers_apart():
    """The rules the table must keep, whatever rows are added: gateway and worker never import each other, and
    kvkernels and kvroute import neither of them nor anything above them."""

    def reaches(row: str, name: str) -> bool:
        return any(allowed(row, target) for target in MAY_IMPORT if target.split("/")[0] == name)

    rows = list(MAY_IMPORT)
    for row in rows:
        top = row.split("/")[0]
        if top == "gateway":
            assert not reaches(row, "worker"), row
        if top == "worker":
            assert not reaches(row, "gateway"), row
        if top in ("kvkernels", "kvroute", "proto"):
            above = {"gateway", "worker", "sim", "loadtest", "launch", "exercises"}
            assert not any(reaches(row, name) for name in above), row


def test_an_upward_import_is_reported_with_its_file_and_line(tmp_path: Path):
    """The scan itself: a kvroute module that imports the gateway, plainly and by name, is caught at each line;
    relative imports resolve from the importer's folder; a folder with no row is named."""
    (tmp_path / "kvroute").mkdir()
    (tmp_path / "kvroute" / "__init__.py").write_text("")
    (tmp_path / "kvroute" / "bad.py").write_text(
        "import importlib\n"
        "from kvroute import hashing\n"
        "from gateway.routing.router import make_policy\n"
        "def later():\n"
        "    return importlib.import_module('worker.engine')\n"
    )
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "routing").mkdir()
    (tmp_path / "gateway" / "routing" / "router.py").write_text(
        "from . import kv_index\nfrom ...kvroute import hashing\n"
    )
    (tmp_path / "gateway" / "bad.py").write_text("from .. import worker\n")
    (tmp_path / "attic").mkdir()
    (tmp_path / "attic" / "old.py").write_text("")
    assert offences(tmp_path) == [
        "attic/old.py: its folder has no row in MAY_IMPORT (tests/test_import_direction.py)",
        "gateway/bad.py:1: gateway imports worker (worker)",
        "kvroute/bad.py:3: kvroute imports gateway.routing.router (gateway/routing)",
        "kvroute/bad.py:5: kvroute imports worker.engine (worker)",
    ]
