"""Pure FIM-prompt functions, checked against examples worked by hand."""

import pytest

from policy.fim import (
    build_fim_prompt,
    earliest_stop,
    parse_prompt,
    safe_emit_length,
    trim_prompt_ids,
)


def test_parse_continue_prompt_with_context():
    prompt = ("<|repo_name|>shop\n<|file_sep|>lib/a.py\nA = 1\n<|file_sep|>lib/b.py\nB = 2\n"
              "<|file_sep|>app.py\n<|fim_prefix|>import lib\nx = <|fim_suffix|>\nprint(x)<|fim_middle|>")
    p = parse_prompt(prompt)
    assert p.repo == "shop"
    assert p.context_files == (("lib/a.py", "A = 1\n"), ("lib/b.py", "B = 2\n"))
    assert p.filepath == "app.py"
    assert (p.prefix, p.suffix) == ("import lib\nx = ", "\nprint(x)")


def test_parse_plain_fim_and_non_fim():
    p = parse_prompt("<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>")
    assert (p.prefix, p.suffix, p.filepath, p.repo) == ("a", "b", None, None)
    assert not parse_prompt("def f():\n").is_fim
    assert not parse_prompt("<|fim_suffix|>x<|fim_prefix|>y<|fim_middle|>").is_fim  # out of order


def test_build_fim_prompt():
    assert build_fim_prompt("x = ", "\n") == "<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>"


# Token ids for the trimming examples: 1 = <|fim_prefix|>, 2 = <|fim_suffix|>, 3 = <|fim_middle|>,
# 4 = <|file_sep|>; everything >= 10 is ordinary text.
SPECIAL = {1, 2, 3, 4}


def test_trim_takes_the_top_of_the_prefix_first():
    ids = [4, 10, 11, 1, 20, 21, 22, 23, 2, 30, 31, 3]
    assert trim_prompt_ids(ids, 12, SPECIAL, 1, 2) == ids
    assert trim_prompt_ids(ids, 10, SPECIAL, 1, 2) == [4, 10, 11, 1, 22, 23, 2, 30, 31, 3]
    # Prefix gone entirely, then the context from its top, then the far end of the suffix.
    assert trim_prompt_ids(ids, 7, SPECIAL, 1, 2) == [4, 11, 1, 2, 30, 31, 3]
    assert trim_prompt_ids(ids, 5, SPECIAL, 1, 2) == [4, 1, 2, 30, 3]
    with pytest.raises(ValueError, match="special tokens alone"):
        trim_prompt_ids(ids, 3, SPECIAL, 1, 2)


def test_trim_plain_prompt_from_the_top():
    assert trim_prompt_ids([10, 11, 12, 13], 2, SPECIAL, 1, 2) == [12, 13]


def test_stops_and_hold_back():
    stops = ("<|endoftext|>", "\n\n")
    assert earliest_stop("ab\n\ncd<|endoftext|>", stops) == 2
    assert earliest_stop("abc", stops) == -1
    assert safe_emit_length("return x<|end", stops) == len("return x")  # may become a stop word
    assert safe_emit_length("return x\n", stops) == len("return x")
    assert safe_emit_length("return x", stops) == len("return x")
    assert safe_emit_length("a<b", stops) == 3  # "<b" can't start "<|endoftext|>"
