"""The two-team bench's pure parts: the teams' conventions, their tasks and their users (trainer/proof/teams.py)."""

from __future__ import annotations

import pytest

from trainer.proof.tasks import FimTask
from trainer.proof.teams import (TEAMS, TeamsConfig, TeamUsers, first_literal_quote, quote_tasks, requote, schedule,
                                 team_of, team_task)


def test_requote_changes_one_line_literals_and_keeps_their_prefix():
    assert requote("""x.split('.') + "a" """, '"') == 'x.split(".") + "a" '
    assert requote("""f"{x}" + rb'\\d'""", "'") == "f'{x}' + rb'\\d'"
    # A literal with a backslash or a quote inside, or a triple-quoted one, is left as it is.
    assert requote("""print('\\n', "it's", '''doc''')""", '"') == """print('\\n', "it's", '''doc''')"""
    with pytest.raises(ValueError, match="a quote is"):
        requote("x", "`")


def test_first_literal_quote_is_the_opening_one_closed_or_not():
    assert first_literal_quote("""f"cannot marshal""") == '"'
    assert first_literal_quote("""b'\\x00')""") == "'"
    assert first_literal_quote("os.sep):") is None
    assert first_literal_quote("""name, 'x'""") == "'"


def _task(middle: str) -> FimTask:
    return FimTask(task_id="t", prefix="    raise ValueError(", suffix="\n", middle=middle)


def test_a_teams_task_has_the_same_prompt_and_the_line_in_its_quotes():
    task = _task("""'bad value: %r' % (x,))""")
    single, double = team_task(task, "single"), team_task(task, "double")
    assert single.prefix == double.prefix == task.prefix and single.suffix == task.suffix
    assert single.middle == task.middle and double.middle == """"bad value: %r" % (x,))"""
    assert (team_of(single), team_of(double)) == ("single", "double")
    with pytest.raises(ValueError, match="no team's"):
        team_of(task)


def test_a_teams_user_takes_only_its_quotes_and_close_lines():
    users = TeamUsers(threshold=0.5)
    task = _task("""'bad value: %r' % (x,))""")
    for team, quote in TEAMS.items():
        mine = team_task(task, team)
        other = "double" if team == "single" else "single"
        assert users.accepts(mine, team_task(task, team).middle)  # its own line
        assert users.accepts(mine, f"{quote}bad value{quote})")  # close enough, its quotes
        assert not users.accepts(mine, team_task(task, other).middle)  # the line, the other team's quotes
        assert not users.accepts(mine, f"{quote}unrelated words here and there{quote} + 1")  # its quotes, far off
        assert not users.accepts(mine, "value)")  # no string at all


def test_quote_tasks_put_the_cursor_before_a_literal_and_keep_the_splits_apart():
    train, heldout = quote_tasks("train"), quote_tasks("heldout")
    assert len(train) > 1000 and len(heldout) > 100
    for task in train[:200] + heldout:
        assert first_literal_quote(task.middle) == task.middle[len(task.middle) - len(task.middle.lstrip("rRbBuUfF"))]
        assert task.prefix.endswith("(") and len(task.middle) <= 40
    assert not {t.filepath for t in train} & {t.filepath for t in heldout}
    assert [t.task_id for t in quote_tasks("heldout", limit=5)] == [t.task_id for t in quote_tasks("heldout", limit=5)]


def test_the_shared_policy_sees_both_teams_in_every_update_on_the_same_tasks():
    train = [_task(f"'m{i}')") for i in range(10)]
    config = TeamsConfig(updates=5, prompts_per_update=4)
    shared = schedule(train, config, list(TEAMS))
    own = {team: schedule(train, config, [team]) for team in TEAMS}
    assert len(shared) == 5 and all(len(u) == 4 for u in shared)
    for u, update in enumerate(shared):
        assert {team_of(t) for t in update} == set(TEAMS)
        assert [t.middle.strip("'\")") for t in update] == [t.middle.strip("'\")") for t in own["single"][u]]
    assert all(team_of(t) == "double" for u in own["double"] for t in u)
