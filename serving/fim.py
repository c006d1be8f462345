"""Fill-in-the-middle prompts as Continue sends them to Qwen2.5-Coder models. Pure functions.

Continue's prompt for a Qwen coder model (with context snippets)::

    <|repo_name|>{repo}\\n<|file_sep|>{path}\\n{snippet}…<|file_sep|>{current path}\\n
    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>

or just the ``<|fim_prefix|>…<|fim_middle|>`` part when there is no context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIM_PREFIX = "<|fim_prefix|>"
FIM_SUFFIX = "<|fim_suffix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_PAD = "<|fim_pad|>"
REPO_NAME = "<|repo_name|>"
FILE_SEP = "<|file_sep|>"
ENDOFTEXT = "<|endoftext|>"

# What Continue stops on for Qwen coder models; the front door adds the ones the client omits.
QWEN_STOP_WORDS = (ENDOFTEXT, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD, REPO_NAME, FILE_SEP,
                   "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class ParsedPrompt:
    """What the prompt says about where the cursor is. ``prefix``/``suffix`` are None for plain prompts."""

    prefix: str | None = None
    suffix: str | None = None
    filepath: str | None = None
    repo: str | None = None
    context_files: tuple[tuple[str, str], ...] = field(default=())

    @property
    def is_fim(self) -> bool:
        return self.prefix is not None


def parse_prompt(prompt: str) -> ParsedPrompt:
    """Split a Qwen FIM prompt into repo, context files, current path, prefix and suffix."""
    start = prompt.rfind(FIM_PREFIX)
    mid = prompt.rfind(FIM_SUFFIX)
    end = prompt.rfind(FIM_MIDDLE)
    if start < 0 or not (start < mid < end):
        return ParsedPrompt()
    prefix = prompt[start + len(FIM_PREFIX):mid]
    suffix = prompt[mid + len(FIM_SUFFIX):end]
    head = prompt[:start]
    repo = None
    if head.startswith(REPO_NAME):
        repo_line, _, head = head[len(REPO_NAME):].partition("\n")
        repo = repo_line or None
    files = []
    for chunk in head.split(FILE_SEP)[1:]:
        path, _, text = chunk.partition("\n")
        files.append((path, text))
    filepath = None
    if files and files[-1][1] == "":  # the current file's header: its path, then the FIM part
        filepath = files.pop()[0] or None
    return ParsedPrompt(prefix=prefix, suffix=suffix, filepath=filepath, repo=repo, context_files=tuple(files))


def build_fim_prompt(prefix: str, suffix: str) -> str:
    """The model's FIM prompt for a request that sent ``prompt`` (the prefix) and ``suffix``."""
    return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"


def trim_prompt_ids(ids: list[int], max_tokens: int, special_ids: set[int], fim_prefix_id: int | None,
                    fim_suffix_id: int | None) -> list[int]:
    """Cut a tokenized prompt to ``max_tokens`` without ever dropping a special (FIM) token.

    What goes first is what matters least to the cursor: the top of the prefix
    (just after ``<|fim_prefix|>``), then the top of the context before it, and
    only then the far end of the suffix.
    """
    excess = len(ids) - max_tokens
    if excess <= 0:
        return ids
    keep = [True] * len(ids)

    def drop(positions):
        nonlocal excess
        for i in positions:
            if excess <= 0:
                return
            if ids[i] not in special_ids and keep[i]:
                keep[i] = False
                excess -= 1

    p = ids.index(fim_prefix_id) if fim_prefix_id in ids else -1
    s = ids.index(fim_suffix_id) if fim_suffix_id in ids else -1
    if p >= 0:
        drop(range(p + 1, s if s > p else len(ids)))  # top of the prefix
        drop(range(0, p))  # top of the context
        if s > p:
            drop(range(len(ids) - 1, s, -1))  # far end of the suffix
    else:
        drop(range(len(ids)))  # a plain prompt: its top
    if excess > 0:
        raise ValueError(f"the prompt's special tokens alone exceed {max_tokens} tokens")
    return [t for t, k in zip(ids, keep) if k]


def earliest_stop(text: str, stops: tuple[str, ...] | list[str]) -> int:
    """Index of the first complete stop string in ``text``, or -1."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else -1


def safe_emit_length(text: str, stops: tuple[str, ...] | list[str]) -> int:
    """How much of ``text`` can be sent now: hold back a tail that may be the start of a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return len(text) - hold
