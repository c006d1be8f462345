"""The layout the README's folder table promises, read from the imports of every module (function-level
imports included: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = (("tabloop",), ("serving", "streams", "trainer"), ("rewards",), ("policy",), ("infra",), ("schemas",))
"""The floors, top first: a module may import only its own folder and the floors below it. Serving, streams
and trainer are peers on one floor (three services that talk through Kafka): none imports another."""
PACKAGES = tuple(package for floor in FLOORS for package in floor)


def module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Each module → the project modules it imports (``from a import b`` counts ``a.b`` when that is a
    module, else ``a``)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: a relative import (the project uses absolute ones)"
                found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                             for a in node.names)
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_projects_modules():
    graph = import_graph()
    assert len(graph) > 60 and "streams.history.sink" in graph["streams.history.cli"]  # the graph is real
    assert cycles(graph) == []


def test_the_floors():
    graph = import_graph()
    top = {m for m in graph if m.split(".")[0] == "tabloop"}
    # The top floor is imported by no area.
    assert {(m, d) for m, ds in graph.items() if m not in top for d in ds if d in top} == set()
    # Settings depend on nothing of ours; the bottom floors (schemas, then infra) on nothing above them.
    assert graph["infra.settings"] == set()
    assert {(m, d) for m, ds in graph.items() if m.startswith("schemas") for d in ds if not d.startswith("schemas")} \
        == set()
    assert {(m, d) for m, ds in graph.items() if m.startswith("infra")
            for d in ds if d.split(".")[0] not in ("infra", "schemas")} == set()


def floor_violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Every import from one folder into a folder above it or beside it: (module, imported)."""
    floor = {package: n for n, packages in enumerate(FLOORS) for package in packages}
    return {(m, d) for m, ds in graph.items() for d in ds
            if m.split(".")[0] != d.split(".")[0] and floor[d.split(".")[0]] <= floor[m.split(".")[0]]}


def test_the_floor_rule_sees_an_arrow_that_runs_up_or_sideways():
    graph = {"serving.app": {"policy.fim", "trainer.online"}, "policy.fim": {"serving.app", "infra.settings"},
             "trainer.online": {"policy.fim", "rewards.spec"}, "rewards.spec": {"policy.fim"},
             "infra.settings": set()}
    assert floor_violations(graph) == {("policy.fim", "serving.app"), ("serving.app", "trainer.online")}


def test_every_arrow_between_folders_runs_down():
    """The policy floor exists so that the front door, the join and the trainer share the model code and
    prompt formats without importing each other upwards (function-level imports count too)."""
    graph = import_graph()
    assert "policy.fim" in graph["streams.join"] and "policy.models" in graph["serving.engines.transformers_engine"]
    assert "rewards.spec" in graph["trainer.online"] and "rewards.scoring" in graph["streams.app"]
    assert floor_violations(graph) == set()


def test_the_readmes_folder_table_names_every_package():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| folder |"):]
    table = table[:table.index("\n\n")]
    listed = set(re.findall(r"^\| `([a-z_/]+)/` \|", table, re.M))
    packages = {str(p.parent.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("__init__.py")}
    packages = {p for p in packages if p.count("/") <= 1 and "engines" not in p}  # serving/engines: in serving's row
    assert listed == packages


MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
"""The README and the docs beside it (issue 30: the README is the overview, each subject a file in docs/)."""


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def relative_links(path: Path) -> list[str]:
    """The targets of the markdown links in ``path`` that are not URLs, outside code blocks and code spans."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for path in MARKDOWN:
        for target in relative_links(path):
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", dest.read_text(), flags=re.M | re.S),
                                      re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_readme_is_short_and_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(ROOT / "README.md")}
    assert [p.name for p in MARKDOWN[1:] if p.resolve() not in linked] == []
