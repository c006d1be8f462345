"""Task loaders (the recipe's format and prefix/suffix/middle), the source-file task builder, HumanEval infilling."""

from __future__ import annotations

import gzip
import json
import textwrap

import pytest

from policy.fim import parse_prompt
from rewards.sandbox import run_tests
from trainer.proof.tasks import (TaskFormatError, build_source_tasks, code_lines, continue_prompt,
                           humaneval_problems, humaneval_tasks, load_tasks, resolve_dataset, save_tasks, source_files,
                           split_of)

RECIPE_PLAIN = {"prompt": "<|fim_prefix|>def add(a, b):\n    return <|fim_suffix|>\n<|fim_middle|>",
                "solutions": "a + b"}
RECIPE_CONTEXT = {"prompt": "<|repo_name|>calc\n<|file_sep|>util.py\ndef sq(x):\n    return x * x\n"
                            "<|file_sep|>calc/main.py\n<|fim_prefix|>from util import sq\nprint(<|fim_suffix|>)\n"
                            "<|fim_middle|>",
                  "solutions": ["sq(3)", "sq(3) "]}


def write_jsonl(path, records, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_recipe_format_loads_prompt_and_solutions(tmp_path):
    tasks = load_tasks(write_jsonl(tmp_path / "fim.jsonl", [RECIPE_PLAIN, RECIPE_CONTEXT]))
    plain, ctx = tasks
    assert (plain.prefix, plain.suffix, plain.middle, plain.solutions) == (
        "def add(a, b):\n    return ", "\n", "a + b", ("a + b",))
    assert plain.fim_prompt() == RECIPE_PLAIN["prompt"]
    assert (ctx.prefix, ctx.suffix, ctx.middle) == ("from util import sq\nprint(", ")\n", "sq(3)")
    assert ctx.solutions == ("sq(3)", "sq(3) ")
    assert (ctx.repo, ctx.filepath, ctx.context_files) == ("calc", "calc/main.py",
                                                            (("util.py", "def sq(x):\n    return x * x\n"),))
    assert ctx.fim_prompt() == RECIPE_CONTEXT["prompt"]  # the exact prompt, as given
    assert plain.task_id == "fim/1" and ctx.source == "recipe"


def test_prefix_suffix_middle_format_and_round_trip(tmp_path):
    records = [{"prefix": "x = ", "suffix": "\n", "middle": "1", "task_id": "a", "test": "assert x == 1"},
               {"prefix": "def f():\n    ", "suffix": "\n", "middle": "pass", "filepath": "f.py"}]
    tasks = load_tasks(write_jsonl(tmp_path / "t.jsonl.gz", records, gz=True))
    assert [(t.task_id, t.prefix, t.middle, t.test) for t in tasks] == [
        ("a", "x = ", "1", "assert x == 1"), ("t.jsonl/2", "def f():\n    ", "pass", None)]
    assert tasks[0].program("1") == "x = 1\n\n\nassert x == 1\n"
    assert save_tasks(tasks, tmp_path / "again.jsonl") == 2
    assert load_tasks(tmp_path / "again.jsonl") == tasks


@pytest.mark.parametrize("line,names", [
    ("{not json", ":1: not JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"prompt": "def f(): <|fim_middle|>", "solutions": "x"}', "not a Qwen FIM prompt"),
    ('{"prompt": "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>"}', "needs 'solutions'"),
    ('{"prompt": "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>", "solutions": []}', "'solutions' must be"),
    ('{"prefix": "a", "middle": "b"}', "'suffix' must be a string"),
    ('{"code": "x"}', "neither format"),
])
def test_bad_records_name_the_line_and_field(tmp_path, line, names):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TaskFormatError) as err:
        load_tasks(path)
    assert names in str(err.value) and str(path) in str(err.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(TaskFormatError, match="does not exist"):
        load_tasks(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TaskFormatError, match="no tasks"):
        load_tasks(tmp_path / "empty.jsonl")


def test_continue_prompt_parses_back():
    prompt = continue_prompt("a = 1\nb = ", "\nprint(b)\n", repo="r", filepath="pkg/m.py",
                             context_files=(("pkg/u.py", "def u():\n    pass"),))
    parsed = parse_prompt(prompt)
    assert (parsed.repo, parsed.filepath, parsed.prefix, parsed.suffix) == ("r", "pkg/m.py", "a = 1\nb = ",
                                                                            "\nprint(b)\n")
    assert parsed.context_files == (("pkg/u.py", "def u():\n    pass\n"),)


# -- the source-file builder -----------------------------------------------------------------

MODULE = textwrap.dedent('''\
    """Module docstring.

    result = this_is_not_code(1, 2)
    """
    import os

    # a comment line that is long enough
    def area(width, height):
        """Docstring line."""
        total = width * height
        if total < 0:
            raise ValueError("negative area")
        return total


    class Box:
        def __init__(self, items):
            self.items = list(items)
            self.count = len(self.items)
    ''')


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "src"
    for i in range(24):
        pkg = root / f"pkg{i % 4}"
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / f"mod{i}.py").write_text(MODULE.replace("area", f"area{i}"))
    (root / "pkg0" / "broken.py").write_bytes(b"\xff\xfe not utf-8")
    return root


def test_cursor_is_inside_a_real_code_line(tree):
    tasks = build_source_tasks(tree, split="all", per_file=6)
    assert len(tasks) > 24
    for t in tasks:
        text = (tree / t.filepath).read_text()
        assert t.prefix + t.middle + t.suffix in text or (t.prefix + t.middle + t.suffix).rstrip("\n") in text
        line_before = t.prefix.rsplit("\n", 1)[-1]
        assert line_before.strip(), "at least one character of the line is typed"
        assert t.middle and t.middle.split("\n")[0], "something of the line is left to complete"
        assert t.suffix.startswith("\n")
        whole_line = line_before + t.middle.split("\n")[0]
        assert "this_is_not_code" not in whole_line and "Docstring" not in whole_line and "#" not in whole_line
    assert any("\n" in t.middle for t in tasks) and any("\n" not in t.middle for t in tasks)


def test_docstrings_and_comments_are_never_cursor_lines():
    lines = MODULE.splitlines()
    chosen = {lines[i].strip() for i in code_lines(MODULE)}
    assert "result = this_is_not_code(1, 2)" not in chosen and '"""Docstring line."""' not in chosen
    assert "# a comment line that is long enough" not in chosen
    assert "total = width * height" in chosen and "self.count = len(self.items)" in chosen


def test_builder_is_deterministic_and_seeded(tree):
    a = build_source_tasks(tree, split="all", seed=3)
    assert a == build_source_tasks(tree, split="all", seed=3)
    assert a != build_source_tasks(tree, split="all", seed=4)


def test_split_is_by_file_and_stable(tree):
    train = build_source_tasks(tree, split="train", heldout_fraction=0.3)
    heldout = build_source_tasks(tree, split="heldout", heldout_fraction=0.3)
    everything = build_source_tasks(tree, split="all")
    train_files, heldout_files = {t.filepath for t in train}, {t.filepath for t in heldout}
    assert train_files and heldout_files and not train_files & heldout_files
    assert train_files | heldout_files == {t.filepath for t in everything}
    assert all(split_of(f, 0.3) == "heldout" for f in heldout_files)
    # A new file changes no other file's split or tasks.
    (tree / "pkg1" / "zzz_new.py").write_text(MODULE)
    after = build_source_tasks(tree, split="heldout", heldout_fraction=0.3)
    assert [t for t in after if t.filepath != "pkg1/zzz_new.py"] == heldout


def test_stdlib_default_split(tmp_path):
    files = [rel for rel, _ in source_files()]
    assert len(files) > 300 and not any(f.startswith("test/") for f in files)
    share = sum(split_of(f) == "heldout" for f in files) / len(files)
    assert 0.05 < share < 0.15
    tasks = build_source_tasks(split="heldout", max_files=5, per_file=2)
    assert tasks and all(split_of(t.filepath) == "heldout" and t.repo == "cpython-stdlib" for t in tasks)
    assert resolve_dataset("stdlib:heldout", limit=3, per_file=2, max_files=5) == \
        resolve_dataset("stdlib:heldout", limit=3, per_file=2, max_files=5)


def test_context_files_come_from_the_same_package(tree):
    t = build_source_tasks(tree, split="all", per_file=1)[0]
    [(path, text)] = t.context_files
    assert path.split("/")[0] == t.filepath.split("/")[0] and path != t.filepath and "import os" in text
    parsed = parse_prompt(t.fim_prompt(with_context=True))
    assert (parsed.prefix, parsed.suffix, parsed.filepath, parsed.repo) == (t.prefix, t.suffix, t.filepath, "src")
    assert t.fim_prompt() == f"<|fim_prefix|>{t.prefix}<|fim_suffix|>{t.suffix}<|fim_middle|>"


# -- HumanEval infilling -------------------------------------------------------------------------

def test_humaneval_tasks_cover_every_problem_deterministically():
    tasks = humaneval_tasks()
    assert len(tasks) == len(humaneval_problems()) == 164
    assert tasks == humaneval_tasks()
    assert any("\n" in t.middle for t in tasks) and any("\n" not in t.middle for t in tasks)
    problems = {p["task_id"]: p for p in humaneval_problems()}
    for t in tasks:
        p = problems[t.task_id.split(":")[0]]
        assert t.prefix.startswith(p["prompt"]) and f"check({p['entry_point']})" in t.test
        # The masked file is the canonical solution, the cursor after the line's indentation.
        assert (t.prefix + t.middle + t.suffix).rstrip("\n") == (p["prompt"] + p["canonical_solution"]).rstrip("\n")
        assert not t.prefix.rsplit("\n", 1)[-1].strip() and t.middle.strip() == t.middle.strip(" ")


def test_humaneval_splits_by_problem_number_and_cover_the_set():
    train, heldout = resolve_dataset("humaneval:train"), resolve_dataset("humaneval:heldout")
    number = lambda t: int(t.task_id.split("/")[1].split(":")[0])  # noqa: E731
    assert sorted(number(t) for t in train) == list(range(100))
    assert sorted(number(t) for t in heldout) == list(range(100, 164))
    assert train + heldout == resolve_dataset("humaneval")  # the same tasks, in problem order
    with pytest.raises(TaskFormatError, match="humaneval's splits are train"):
        resolve_dataset("humaneval:test")


def test_humaneval_canonical_span_passes_and_a_wrong_one_fails():
    tasks = [t for t in humaneval_tasks(mode="line") if t.middle.startswith("return ")][:4]
    spans = [t for t in humaneval_tasks(mode="span") if t.middle.count("\n") >= 1][:2]
    assert len(tasks) == 4 and len(spans) == 2
    for t in tasks + spans:
        assert run_tests(t.program(t.middle)).passed, t.task_id
    for t in tasks:
        result = run_tests(t.program("return None"))
        assert not result.passed and result.outcome == "failed", t.task_id
    for t in spans:
        assert not run_tests(t.program("pass")).passed, t.task_id


def test_tasks_build_cli_writes_loadable_jsonl(tmp_path):
    from click.testing import CliRunner

    from tabloop.cli import main

    out = tmp_path / "he.jsonl"
    result = CliRunner().invoke(main, ["tasks", "build", "humaneval", "--limit", "5", "--out", str(out)],
                                env={"TABLOOP_STATE_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["tasks"] == 5
    loaded = load_tasks(out)
    assert len(loaded) == 5 and all(t.test and t.source == "humaneval" for t in loaded)
    bad = CliRunner().invoke(main, ["tasks", "build", "nowhere.jsonl", "--out", str(out)])
    assert bad.exit_code == 1 and "does not exist" in bad.output
