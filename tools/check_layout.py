"""Code-layout report for the megaulysses package (issue 26): is the refactor done yet?

    python tools/check_layout.py [--root DIR] [--verbose] [--json]

Static: every file is read with `ast`; nothing is imported (no megaulysses, no torch), so
it runs in well under a second anywhere. Exit 0 when every rule holds, 1 when one breaks
(what breaks it is listed), 2 on bad usage.

What is measured, and over which files:

1. Functions over 60 lines (rule: none). Every def, async def and method, nested ones
   included; the span is `end_lineno - lineno + 1` (decorators excluded, docstring
   included). Files: megaulysses/**/*.py, pretrain_gpt.py and tools/*.py, so that
   moving a long function out of the package into a script does not count as fixing it.
2. Import cycles (rule: none). A graph of imports between megaulysses modules, built
   from every `import` / `from ... import` anywhere in a file: module level, inside
   functions (lazy imports), inside try/if blocks. Left out: only the imports guarded by
   `if TYPE_CHECKING:` (they never run; their count is reported). Relative imports are
   resolved; `from megaulysses.x import y` is an edge to megaulysses.x.y when y is a
   submodule, else to megaulysses.x; importing a package is an edge to its __init__.
   Python also runs the parent packages' __init__ of the module named (importing
   megaulysses.a.b runs megaulysses/a/__init__.py); that implicit edge is NOT counted,
   only the named module is. A cycle through a package __init__ is still found when a
   module imports a name the __init__ re-exports (`from megaulysses.a import name`
   where name is not a submodule: an explicit edge to the __init__). Strongly connected
   components of more than one module are reported, with the imports inside them.
   Not seen: imports made through importlib or __import__ with computed names.
3. No upward import (rule: none, and no unplaced module). LAYERS below: a module may
   import its own layer or a lower one; two different layers of the same rank (data,
   hardware) may not import each other. Lazy imports count (a lazy upward import is
   still a dependency). TYPE_CHECKING-only imports do not (no runtime dependency).
   A megaulysses module that matches no entry of LAYERS is "unplaced" and fails the
   rule, so the table is kept current. Importing pretrain_gpt.py or tools/ from the
   package is upward too (those scripts sit above every layer).
4. Public functions fully typed (rule: >= 90%). Public: a module-level function or a
   method of a module-level class, neither name starting with "_", in a module whose
   dotted name has no part starting with "_" (__init__.py files are public). Dunder
   methods are left out, except __init__, which needs its parameters typed but no
   return annotation. Fully typed: every parameter (self/cls, the first parameter of a
   method that is not a staticmethod, excepted; *args and **kwargs included) annotated,
   and a return annotation. Files: megaulysses/**/*.py only (scripts are not imported).
   --verbose lists the untyped ones.
5. Files over 400 lines (rule: at most 2). Files: megaulysses/**/*.py only.

Informational, no rule: number of modules, total lines of the package, the longest
function, the TYPE_CHECKING-only imports, imports of megaulysses names that match no file.
A file that does not parse fails the report (it cannot be measured).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

PACKAGE = "megaulysses"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400
MAX_LONG_FILES = 2
MIN_TYPED_PERCENT = 90

# The layers, lowest first, as (module prefix, rank). Each layer uses only what is below
# it: data reads files (tokenizers, indexed datasets) and hardware describes the GPUs;
# both are the bottom and know nothing of each other. config is the schema of a run and
# its rules; model is the plain, single-device GPT built from a config; parallel
# transforms that model over the data x tensor x pipeline x sequence grid; planner models
# the memory and the time of such a parallel run; training runs it. A module belongs to
# the longest prefix that names it or one of its parent packages; equal ranks with
# different prefixes may not import each other. The package's own megaulysses/__init__.py
# sits above everything (matched exactly, not as a prefix: a new top-level module such as
# megaulysses/errors.py is unplaced until it is added here). Top-level scripts
# (pretrain_gpt.py, tools/) are above all of it.
LAYERS: tuple[tuple[str, int], ...] = (
    ("megaulysses.hardware", 0),
    ("megaulysses.torch_internals", 0),  # the list of torch's private parts in use
    ("megaulysses.data", 0),
    ("megaulysses.config", 1),
    ("megaulysses.model", 2),
    ("megaulysses.parallel", 3),
    ("megaulysses.planner", 4),
    ("megaulysses.training", 5),
)
PACKAGE_INIT_RANK = 6
SCRIPT_RANK = 7


@dataclass
class Source:
    """One file: `name` is the dotted module name for package files, the path otherwise."""

    path: str  # relative to the root, with "/"
    name: str
    in_package: bool
    is_package: bool
    lines: int
    tree: ast.Module | None


@dataclass
class Edge:
    src: str
    dst: str
    path: str
    line: int
    lazy: bool  # inside a function


@dataclass
class Function:
    path: str
    line: int
    name: str  # qualified: Class.method, outer.<locals>.inner
    lines: int


@dataclass
class Untyped:
    path: str
    line: int
    name: str
    missing: list[str]


@dataclass
class Report:
    root: str
    modules: int = 0
    lines: int = 0
    longest: Function | None = None
    unparsed: list[str] = field(default_factory=list)
    long_functions: list[Function] = field(default_factory=list)
    cycles: list[dict] = field(default_factory=list)
    upward: list[dict] = field(default_factory=list)
    unplaced: list[str] = field(default_factory=list)
    typed: int = 0
    public: int = 0
    untyped: list[Untyped] = field(default_factory=list)
    long_files: list[dict] = field(default_factory=list)
    type_checking_imports: int = 0
    unresolved: list[dict] = field(default_factory=list)

    @property
    def typed_percent(self) -> float:
        return 100.0 * self.typed / self.public if self.public else 100.0

    def rules(self) -> dict[str, bool]:
        return {
            "function_length": not self.long_functions,
            "import_cycles": not self.cycles,
            "layering": not self.upward and not self.unplaced,
            "typing": self.typed * 100 >= MIN_TYPED_PERCENT * self.public,
            "file_length": len(self.long_files) <= MAX_LONG_FILES,
            "parses": not self.unparsed,
        }

    @property
    def ok(self) -> bool:
        return all(self.rules().values())


# ---------------------------------------------------------------- reading the files


def module_name(relpath: str) -> tuple[str, bool]:
    """megaulysses/a/b.py -> ("megaulysses.a.b", False); megaulysses/a/__init__.py ->
    ("megaulysses.a", True)."""
    parts = relpath[:-len(".py")].split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def read_source(root: str, relpath: str, in_package: bool) -> Source:
    with open(os.path.join(root, relpath), encoding="utf-8") as f:
        text = f.read()
    try:
        tree: ast.Module | None = ast.parse(text, filename=relpath)
    except SyntaxError:
        tree = None
    if in_package:
        name, is_package = module_name(relpath)
    else:
        name, is_package = relpath, False
    return Source(relpath, name, in_package, is_package, len(text.splitlines()), tree)


def discover(root: str) -> list[Source]:
    """The package's files, then pretrain_gpt.py and tools/*.py, in a stable order."""
    package_dir = os.path.join(root, PACKAGE)
    if not os.path.isdir(package_dir):
        raise FileNotFoundError(f"no {PACKAGE}/ package under {root}")
    relpaths = []
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        relpaths += [f"{rel}/{f}" for f in sorted(filenames) if f.endswith(".py")]
    sources = [read_source(root, p, True) for p in sorted(relpaths)]
    scripts = ["pretrain_gpt.py"] if os.path.isfile(os.path.join(root, "pretrain_gpt.py")) else []
    tools_dir = os.path.join(root, "tools")
    if os.path.isdir(tools_dir):
        scripts += [f"tools/{f}" for f in sorted(os.listdir(tools_dir)) if f.endswith(".py")]
    return sources + [read_source(root, p, False) for p in scripts]


# ---------------------------------------------------------------- rule 1: function length


FuncDef = ast.FunctionDef | ast.AsyncFunctionDef
Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def iter_functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, FuncDef]]:
    """Every function and method with its qualified name, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from iter_functions(node, f"{prefix}{node.name}.<locals>.")
        elif isinstance(node, ast.ClassDef):
            yield from iter_functions(node, f"{prefix}{node.name}.")
        else:
            yield from iter_functions(node, prefix)


def function_spans(source: Source) -> list[Function]:
    if source.tree is None:
        return []
    # end_lineno: set by ast.parse (None only on nodes built by hand)
    return [Function(source.path, node.lineno, name,
                     (node.end_lineno or node.lineno) - node.lineno + 1)
            for name, node in iter_functions(source.tree)]


# ---------------------------------------------------------------- rules 2 and 3: imports


def is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def iter_imports(node: ast.AST, guarded: bool = False,
                 lazy: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """(import node, guarded by TYPE_CHECKING, inside a function) for every import."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, guarded, lazy
        return
    if isinstance(node, ast.If):
        test, negated = node.test, False
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, negated = test.operand, True
        if is_type_checking(test):
            for stmt in node.body:
                yield from iter_imports(stmt, guarded or not negated, lazy)
            for stmt in node.orelse:
                yield from iter_imports(stmt, guarded or negated, lazy)
            return
    inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    for child in ast.iter_child_nodes(node):
        yield from iter_imports(child, guarded, inner)


def import_base(node: ast.ImportFrom, importer: Source) -> str | None:
    """The module a `from X import ...` names, relative imports resolved."""
    if not node.level:
        return node.module
    if not importer.in_package:
        return None  # a relative import in a script: not into the package
    package = importer.name if importer.is_package else importer.name.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        return None
    base = ".".join(parts[:len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def import_targets(node: ast.Import | ast.ImportFrom, importer: Source,
                   known: set[str]) -> list[str]:
    """The modules one import statement names (a submodule where `from` names one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = import_base(node, importer)
    if base is None:
        return []
    targets = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        target = sub if alias.name != "*" and sub in known else base
        if target not in targets:
            targets.append(target)
    return targets


def in_package(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def is_script(name: str) -> bool:
    return name in ("pretrain_gpt", "tools") or name.startswith("tools.")


def import_edges(sources: list[Source], report: Report) -> list[Edge]:
    """Edges from package modules to package modules (and to scripts, for rule 3)."""
    known = {s.name for s in sources if s.in_package}
    edges: list[Edge] = []
    seen: set[tuple[str, str, int]] = set()
    for source in sources:
        if not source.in_package or source.tree is None:
            continue
        for node, guarded, lazy in iter_imports(source.tree):
            for target in import_targets(node, source, known):
                if not (in_package(target) or is_script(target)):
                    continue
                if guarded:
                    report.type_checking_imports += 1
                    continue
                if in_package(target) and target not in known:
                    report.unresolved.append(
                        {"path": source.path, "line": node.lineno, "module": target})
                    continue
                key = (source.name, target, node.lineno)
                if key not in seen:
                    seen.add(key)
                    edges.append(Edge(source.name, target, source.path, node.lineno, lazy))
    return edges


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit); components in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return sorted(components)


def find_cycles(edges: list[Edge]) -> list[dict]:
    graph: dict[str, set[str]] = {}
    for edge in edges:
        if in_package(edge.dst):
            graph.setdefault(edge.src, set()).add(edge.dst)
            graph.setdefault(edge.dst, set())
    cycles = []
    for component in strongly_connected(graph):
        if len(component) < 2:
            continue
        members = set(component)
        inside = [asdict(e) for e in edges if e.src in members and e.dst in members]
        cycles.append({"modules": component, "imports": inside})
    return cycles


def layer_of(name: str) -> tuple[str, int] | None:
    if is_script(name):
        return "scripts", SCRIPT_RANK
    if name == PACKAGE:
        return PACKAGE + "/__init__", PACKAGE_INIT_RANK
    best = None
    for prefix, rank in LAYERS:
        if (name == prefix or name.startswith(prefix + ".")) and (
                best is None or len(prefix) > len(best[0])):
            best = (prefix, rank)
    return best


def check_layers(sources: list[Source], edges: list[Edge], report: Report) -> None:
    report.unplaced = sorted(s.name for s in sources if s.in_package and layer_of(s.name) is None)
    for edge in edges:
        src, dst = layer_of(edge.src), layer_of(edge.dst)
        if src is None or dst is None or src[0] == dst[0] or dst[1] < src[1]:
            continue  # unplaced modules are reported as such
        report.upward.append({"path": edge.path, "line": edge.line, "src": edge.src,
                              "src_layer": src[0], "dst": edge.dst, "dst_layer": dst[0],
                              "lazy": edge.lazy})


# ---------------------------------------------------------------- rule 4: typing


def is_private_module(name: str) -> bool:
    return any(part.startswith("_") for part in name.split("."))


def toplevel_defs(body: list[ast.stmt]) -> Iterator[Def]:
    """Definitions at this level, through if/try/with blocks but not into defs/classes."""
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield stmt
        else:
            for name in ("body", "orelse", "finalbody", "handlers"):
                nested = getattr(stmt, name, None)
                if isinstance(nested, list):
                    yield from toplevel_defs(nested)


def missing_annotations(func: FuncDef, is_method: bool) -> list[str]:
    args = func.args
    positional = args.posonlyargs + args.args
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in func.decorator_list)
    if is_method and not static and positional:
        positional = positional[1:]  # self / cls
    params = positional + args.kwonlyargs
    missing = [a.arg for a in params if a.annotation is None]
    missing += [f"*{a.arg}" for a in (args.vararg,) if a is not None and a.annotation is None]
    missing += [f"**{a.arg}" for a in (args.kwarg,) if a is not None and a.annotation is None]
    if func.returns is None and not (is_method and func.name == "__init__"):
        missing.append("return")
    return missing


def public_functions(source: Source) -> Iterator[tuple[str, FuncDef, bool]]:
    """(qualified name, def, is a method) of every public function of a module."""
    if source.tree is None or not source.in_package or is_private_module(source.name):
        return
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for func in toplevel_defs(source.tree.body):
        if isinstance(func, funcs) and not func.name.startswith("_"):
            yield func.name, func, False
    for cls in toplevel_defs(source.tree.body):
        if not isinstance(cls, ast.ClassDef) or cls.name.startswith("_"):
            continue
        for func in toplevel_defs(cls.body):
            if isinstance(func, funcs) and (func.name == "__init__"
                                            or not func.name.startswith("_")):
                yield f"{cls.name}.{func.name}", func, True


def check_typing(sources: list[Source], report: Report) -> None:
    for source in sources:
        for name, func, is_method in public_functions(source):
            report.public += 1
            missing = missing_annotations(func, is_method)
            if missing:
                report.untyped.append(Untyped(source.path, func.lineno, name, missing))
            else:
                report.typed += 1
    report.untyped.sort(key=lambda u: (u.path, u.line))


# ---------------------------------------------------------------- the report


def analyze(root: str) -> Report:
    root = os.path.abspath(root)
    sources = discover(root)
    package = [s for s in sources if s.in_package]
    report = Report(root=root, modules=len(package), lines=sum(s.lines for s in package))
    report.unparsed = [s.path for s in sources if s.tree is None]
    spans = [f for s in sources for f in function_spans(s)]
    report.long_functions = sorted((f for f in spans if f.lines > MAX_FUNCTION_LINES),
                                   key=lambda f: (-f.lines, f.path, f.line))
    report.longest = max(spans, key=lambda f: f.lines, default=None)
    edges = import_edges(sources, report)
    report.cycles = find_cycles(edges)
    check_layers(sources, edges, report)
    check_typing(sources, report)
    report.long_files = sorted(({"path": s.path, "lines": s.lines} for s in package
                                if s.lines > MAX_FILE_LINES), key=lambda f: -f["lines"])
    return report


def format_rule(ok: bool, title: str) -> str:
    return f"[{'ok' if ok else 'FAIL'}] {title}"


def format_imports(report: Report, rules: dict[str, bool]) -> list[str]:
    out = [format_rule(rules["import_cycles"], f"import cycles: {len(report.cycles)} "
                                              "(rule: none; lazy imports count)")]
    for cycle in report.cycles:
        out.append(f"  {len(cycle['modules'])} modules: {', '.join(cycle['modules'])}")
        for e in cycle["imports"]:
            lazy = "  (lazy)" if e["lazy"] else ""
            out.append(f"    {e['path']}:{e['line']}  {e['src']} -> {e['dst']}{lazy}")
    out.append(format_rule(rules["layering"], f"upward imports: {len(report.upward)}, "
                                              f"unplaced modules: {len(report.unplaced)} "
                                              "(rule: none)"))
    for u in report.upward:
        lazy = "  (lazy)" if u["lazy"] else ""
        out.append(f"  {u['path']}:{u['line']}  {u['src']} [{u['src_layer']}] imports "
                   f"{u['dst']} [{u['dst_layer']}]{lazy}")
    out += [f"  unplaced: {name} (add it to LAYERS)" for name in report.unplaced]
    return out


def format_report(report: Report, verbose: bool = False) -> str:
    rules = report.rules()
    longest = report.longest
    out = [f"{PACKAGE} layout, {report.root}: {report.modules} modules, {report.lines} lines"]
    if longest is not None:
        out.append(f"longest function: {longest.name} ({longest.path}:{longest.line}), "
                   f"{longest.lines} lines")
    out.append(format_rule(rules["function_length"], f"functions over {MAX_FUNCTION_LINES} "
                           f"lines: {len(report.long_functions)} (rule: none)"))
    out += [f"  {f.lines:4d}  {f.path}:{f.line}  {f.name}" for f in report.long_functions]
    out += format_imports(report, rules)
    out.append(format_rule(rules["typing"], f"public functions fully typed: "
                           f"{report.typed_percent:.1f}% ({report.typed}/{report.public}) "
                           f"(rule: >= {MIN_TYPED_PERCENT}%)"))
    if verbose:
        out += [f"  {u.path}:{u.line}  {u.name}: {', '.join(u.missing)}" for u in report.untyped]
    elif report.untyped:
        out.append(f"  {len(report.untyped)} untyped (--verbose lists them)")
    out.append(format_rule(rules["file_length"], f"files over {MAX_FILE_LINES} lines: "
                           f"{len(report.long_files)} (rule: at most {MAX_LONG_FILES})"))
    out += [f"  {f['lines']:4d}  {f['path']}" for f in report.long_files]
    if report.unparsed:
        out.append(format_rule(False, f"files that do not parse: {', '.join(report.unparsed)}"))
    out.append(f"(info) TYPE_CHECKING-only imports, not in the graph: "
               f"{report.type_checking_imports}")
    out += [f"(info) import of no file: {u['path']}:{u['line']} {u['module']}"
            for u in report.unresolved]
    failed = [name for name, ok in rules.items() if not ok]
    out.append("all rules hold" if not failed else
               f"{len(failed)} rule(s) fail: {', '.join(failed)}")
    return "\n".join(out)


def report_json(report: Report) -> dict:
    data = asdict(report)
    data.update(typed_percent=round(report.typed_percent, 2), rules=report.rules(),
                ok=report.ok, limits={"function_lines": MAX_FUNCTION_LINES,
                                      "file_lines": MAX_FILE_LINES,
                                      "long_files": MAX_LONG_FILES,
                                      "typed_percent": MIN_TYPED_PERCENT})
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), help="the checkout (default: this tool's)")
    parser.add_argument("--verbose", action="store_true", help="list the untyped functions")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args(argv)
    try:
        report = analyze(args.root)
    except FileNotFoundError as e:
        print(f"check_layout: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report_json(report), indent=1))
    else:
        print(format_report(report, args.verbose))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
