"""Fill-in-the-middle prompts as Continue sends them, and as the served model wants them. Pure functions.

Continue's prompt for a Qwen coder model (with context snippets)::

    <|repo_name|>{repo}\\n<|file_sep|>{path}\\n{snippet}…<|file_sep|>{current path}\\n
    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>

or just the ``<|fim_prefix|>…<|fim_middle|>`` part when there is no context.
For StarCoder-family models it sends ``<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>``
(context as ``<reponame>``/``<file_sep>`` headers); a request may also carry the
prefix as ``prompt`` and the rest as ``suffix``. ``parse_prompt`` reads any of
these into the same parts, and ``render_prompt`` writes them in the served
model's own format (``prompt_format``): Qwen's FIM tokens, StarCoder's, or —
for a model without FIM tokens, such as SmolLM2 — the end of the prefix alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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

# StarCoder's template (StarCoder, StarCoder2, SantaCoder, stable-code…), as Continue writes it.
SC_FIM_PREFIX = "<fim_prefix>"
SC_FIM_SUFFIX = "<fim_suffix>"
SC_FIM_MIDDLE = "<fim_middle>"
SC_REPO_NAME = "<reponame>"
SC_FILE_SEP = "<file_sep>"

_TEMPLATES = {  # kind: (prefix, suffix, middle, repo header, file separator)
    "qwen": (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, REPO_NAME, FILE_SEP),
    "starcoder": (SC_FIM_PREFIX, SC_FIM_SUFFIX, SC_FIM_MIDDLE, SC_REPO_NAME, SC_FILE_SEP),
}

DEFAULT_PREFIX_CHARS = 1200
"""How much of the prefix a model without FIM tokens sees (SmolLM2: 25 % of 40 held-out tasks accepted by
the similarity-0.5 user with 1,200; the end of the prefix is what predicts the next line)."""


@dataclass(frozen=True)
class ParsedPrompt:
    """What the prompt says about where the cursor is. ``prefix``/``suffix`` are None for plain prompts."""

    prefix: str | None = None
    suffix: str | None = None
    filepath: str | None = None
    repo: str | None = None
    context_files: tuple[tuple[str, str], ...] = field(default=())
    template: str | None = None
    """Which FIM template the prompt was written in: "qwen" or "starcoder"; None for plain prompts."""

    @property
    def is_fim(self) -> bool:
        return self.prefix is not None


def parse_prompt(prompt: str) -> ParsedPrompt:
    """Split a FIM prompt (Qwen's or StarCoder's template) into repo, context files, current path, prefix
    and suffix; a prompt in neither template is plain (``is_fim`` False)."""
    for kind, (tp, ts, tm, trepo, tsep) in _TEMPLATES.items():
        start, mid, end = prompt.rfind(tp), prompt.rfind(ts), prompt.rfind(tm)
        if start >= 0 and start < mid < end:
            break
    else:
        return ParsedPrompt()
    prefix = prompt[start + len(tp):mid]
    suffix = prompt[mid + len(ts):end]
    head = prompt[:start]
    repo = None
    if head.startswith(trepo):
        repo_line, _, head = head[len(trepo):].partition("\n")
        repo = repo_line or None
    files = []
    for chunk in head.split(tsep)[1:]:
        path, _, text = chunk.partition("\n")
        files.append((path, text))
    filepath = None
    if files and files[-1][1] == "":  # the current file's header: its path, then the FIM part
        filepath = files.pop()[0] or None
    return ParsedPrompt(prefix=prefix, suffix=suffix, filepath=filepath, repo=repo, context_files=tuple(files),
                        template=kind)


def build_fim_prompt(prefix: str, suffix: str) -> str:
    """The model's FIM prompt for a request that sent ``prompt`` (the prefix) and ``suffix``."""
    return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"


@dataclass(frozen=True)
class PromptFormat:
    """How the served model wants its prompt: which FIM template, if any, and what ends a completion."""

    kind: Literal["qwen", "starcoder", "prefix"]
    """qwen / starcoder: the model has that template's FIM tokens; prefix: it has none, so it sees the
    end of the prefix and continues it (the suffix is not shown to it)."""
    stop_words: tuple[str, ...] = ()
    """The model's own end and control tokens as text: a completion stops at any of them."""
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    """prefix kind: how many characters of the prefix it sees."""
    path_comment: bool = False
    """prefix kind: start the prompt with ``# path: {file}`` when the client named the file."""

    @property
    def fim_tokens(self) -> tuple[str, str] | None:
        """(prefix token, suffix token) of the template, for trimming; None for the prefix kind."""
        return _TEMPLATES[self.kind][:2] if self.kind in _TEMPLATES else None


def prompt_format(tokenizer, *, prefix_chars: int = DEFAULT_PREFIX_CHARS, path_comment: bool = False) -> PromptFormat:
    """The prompt format of the model behind ``tokenizer``, from its vocabulary: Qwen's FIM tokens, else
    StarCoder's, else prefix-only. Stop words are the tokenizer's special tokens (its EOS first)."""
    cache_key = (prefix_chars, path_comment)
    cached = getattr(tokenizer, "_tabloop_prompt_format", None)  # get_vocab() costs milliseconds on 150k tokens
    if cached is not None and cached[0] == cache_key:
        return cached[1]
    vocab = tokenizer.get_vocab()
    kind = next((k for k, (tp, ts, tm, *_) in _TEMPLATES.items() if tp in vocab and ts in vocab and tm in vocab),
                "prefix")
    specials = [tokenizer.eos_token, *getattr(tokenizer, "all_special_tokens", ())]
    stops = tuple(dict.fromkeys(t for t in specials if isinstance(t, str) and t))
    fmt = PromptFormat(kind=kind, stop_words=stops, prefix_chars=prefix_chars, path_comment=path_comment)
    try:
        tokenizer._tabloop_prompt_format = (cache_key, fmt)
    except AttributeError:  # a tokenizer that takes no attributes is just asked again
        pass
    return fmt


def render_prompt(prompt: str, fmt: PromptFormat) -> str:
    """``prompt`` (as the client sent it, or built from prompt + suffix) in the served model's format.

    A FIM prompt in the model's own template goes through unchanged; one in the other template is
    rewritten into the model's; for a model without FIM tokens it becomes the last ``prefix_chars``
    characters of the prefix, cut at a line start so the model never starts mid-line (unless the cut
    line is the cursor's own). A plain prompt is left as it is: it already is a left-to-right text.
    """
    parsed = parse_prompt(prompt)
    if not parsed.is_fim or parsed.template == fmt.kind:
        return prompt
    if fmt.kind in _TEMPLATES:
        tp, ts, tm, trepo, tsep = _TEMPLATES[fmt.kind]
        head = f"{trepo}{parsed.repo}\n" if parsed.repo else ""
        files = [*parsed.context_files, *([(parsed.filepath, "")] if parsed.filepath else [])]
        head += "".join(f"{tsep}{path}\n{text}" for path, text in files)
        return f"{head}{tp}{parsed.prefix}{ts}{parsed.suffix}{tm}"
    return prefix_only_prompt(parsed.prefix, parsed.filepath if fmt.path_comment else None, fmt.prefix_chars)


def prefix_only_prompt(prefix: str, filepath: str | None = None, max_chars: int = DEFAULT_PREFIX_CHARS) -> str:
    """The end of ``prefix`` (at most ``max_chars`` characters, from a line start when the cut falls inside
    an earlier line), after an optional ``# path: …`` comment line."""
    if len(prefix) > max_chars:
        tail = prefix[-max_chars:]
        nl = tail.find("\n")
        # Start at the first whole line; keep the cut line only when nothing would be left after it
        # (one line longer than the budget).
        prefix = tail[nl + 1:] if nl >= 0 and tail[nl + 1:] else tail
    head = f"# path: {filepath}\n" if filepath else ""
    return head + prefix


def prompt_token_ids(tokenizer, prompt: str, max_tokens: int, fmt: PromptFormat | None = None) -> tuple[list[int], str]:
    """(ids, text) of ``prompt`` rendered for the model behind ``tokenizer`` and trimmed to ``max_tokens``
    without dropping a special token (``trim_prompt_ids``); what the front door feeds the engine and what
    offline evaluation and training feed the model. ``text`` is the rendered prompt, decoded again when
    trimmed. Raises ValueError when the special tokens alone exceed the budget."""
    fmt = fmt or prompt_format(tokenizer)
    text = render_prompt(prompt, fmt)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return ids, text
    special = set(tokenizer.all_special_ids)
    fim_prefix_id = fim_suffix_id = None
    if fmt.fim_tokens:
        template_ids = tokenizer.convert_tokens_to_ids(list(_TEMPLATES[fmt.kind]))
        special |= {i for i in template_ids if i is not None}
        fim_prefix_id, fim_suffix_id = template_ids[0], template_ids[1]
    ids = trim_prompt_ids(ids, max_tokens, special, fim_prefix_id, fim_suffix_id)
    return ids, tokenizer.decode(ids, skip_special_tokens=False)


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
