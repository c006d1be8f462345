"""Every `tabloop bench …` command, at its smallest, as a user runs it: it exits 0 and its last line is the
JSON its figures are read from, holding measurements (the counts it was asked for, rates above 0), not
placeholders. (`bench loop --quick` runs in the drills: tests/test_loop_bench.py.) Speed itself is never
asserted here: the benches are where speed is measured."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from infra.settings import Settings, to_environ
from schemas.events import EVENT_TYPES
from tests.conftest import make_settings
from tests.system_helpers import processes_of

pytestmark = pytest.mark.kafka


def check_codec(r):
    assert set(r["types"]) == set(EVENT_TYPES) and r["events_per_type"] == 200
    assert all(t["encode_per_s"] > 0 and t["decode_per_s"] > 0 and t["bytes_per_event"] > 0
               for t in r["types"].values()), r


def check_kafka(r):
    assert (r["events"], r["consumed"], r["decode_errors"], r["partitions"]) == (1000, 1000, 0, 2)
    assert r["produce_per_s"] > 0 and r["consume_per_s"] > 0 and r["bytes_per_event"] > 0


def check_history(r):
    assert r["events"] == 1000 and 0 < r["sink_rows"] < 1000 and r["sink_rows_per_s"] > 0 and r["sink_batches"] >= 2
    assert r["episodes"] == 1000 and r["acceptance_by_version_rows"] > 0 and r["acceptance_by_version_query_s"] > 0
    # the timed batches' time split: polling and storing, both within it (the commits are the rest)
    assert 0 < r["sink_polling_s"] and 0 < r["sink_storing_s"] and r["sink_polling_s"] + r["sink_storing_s"] <= r["sink_seconds"]


def check_pipeline(r):
    assert r["backlog_episodes"] == 100 and r["live_complete"] is True and r["live_episodes"] > 0
    assert r["workers"] == 2  # two workers share the partitions; every episode still arrives
    assert r["episodes_per_s"] > 0 and 0 < r["latency_ms_p50"] <= r["latency_ms_p99"]


def check_serving(r):
    assert (r["clients"], r["requests"]) == (2, 4)
    for side in ("engine", "front_door"):  # the overheads between them may come out negative in noise
        assert 0 < r[side]["ttft_ms"]["p50"] <= r[side]["ttft_ms"]["p95"], r
        assert 0 < r[side]["latency_ms"]["p50"] <= r[side]["latency_ms"]["p95"], r


def check_trainer(r):
    assert (r["updates"], r["batch"], r["device"]) == (1, 2, "cpu") and "full" not in r
    assert r["lora"]["seconds_per_update"] > 0 and 0 < r["lora"]["trainable_parameters"] < r["lora"]["parameters"]


def check_adapters(r):
    assert (r["rows"], r["rank"], len(r["step_ms"]), len(r["adapter_load_ms"])) == (3, 2, 2, 2)
    for step_ms, ratios in zip(r["step_ms"], r["vs_merged"]):
        assert set(step_ms) == {"merged_copy", "one_adapter", "2_adapters_mixed", "base_rows_via_peft"}
        assert all(ms > 0 for ms in step_ms.values()) and ratios["merged_copy"] == 1.0
    assert all(ms > 0 for ms in r["adapter_load_ms"])


def check_teams(r, out_dir):
    """The figures are what the bench's own decision rows (heldout.jsonl) say, each row rewarded by the
    reward spec (accepted 0.75, rejected -0.25, nothing shown --ignored-reward 0): not merely in range."""
    assert (r["train_tasks"], r["heldout_tasks"]) == (8, 4) and set(r["comparison"]) == {"single", "double"}
    rows = [json.loads(line) for line in (out_dir / "heldout.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["reward"] == {"ACCEPTED": 0.75, "REJECTED": -0.25}.get(row["outcome"], 0.0), row
        assert (row["shown"] is not None) == (row["outcome"] in ("ACCEPTED", "REJECTED")), row
    for team, figures in r["comparison"].items():
        assert set(figures["shown_share"]) == set(figures["reward_mean"]) == {"base", "shared", "own"}
        for label, policy in (("base", "base"), ("shared", "shared"), ("own", f"team:{team}")):
            mine = [row for row in rows if (row["policy"], row["team"]) == (policy, team)]
            assert len(mine) == 4, (policy, team, len(mine))
            assert figures["reward_mean"][label] == round(sum(row["reward"] for row in mine) / 4, 4), (team, label)
            assert figures["shown_share"][label] == round(sum(row["shown"] is not None for row in mine) / 4, 4)


# name: (arguments, settings for the run, the check of its JSON)
BENCHES = {
    "codec": (["--events", "200"], {}, check_codec),
    "kafka": (["--events", "1000", "--partitions", "2"], {}, check_kafka),
    # Batches of 200: the first batch waits for the consumer group and is not timed.
    "history": (["--events", "1000", "--episodes", "1000"], {"history_batch_size": 200}, check_history),
    "pipeline": (["--events", "100", "--rate", "20", "--seconds", "2", "--workers", "2"], {}, check_pipeline),
    "serving": (["--clients", "2", "--requests", "2", "--max-tokens", "4", "--rounds", "1"], {}, check_serving),
    "trainer": (["--model-shape", "tiny", "--mode", "lora", "--batch", "2", "--micro-batch", "2",
                 "--prompt-tokens", "16", "--completion-tokens", "4", "--updates", "1", "--device", "cpu"], {},
                check_trainer),
    "adapters": (["--rows", "3", "--adapters", "2", "--rounds", "2", "--rank", "2"], {}, check_adapters),
    "teams": (["--updates", "1", "--heldout", "4", "--train-limit", "8", "--group-size", "2", "--out", "{tmp}/teams"],
              {}, check_teams),
}


def bench_command(name: str, args: list[str], kafka, tiny_model, tmp_path, **settings) -> tuple[list[str], dict]:
    """The command line and environment of a bench run; its temporary files go to ``tmp_path/scratch``."""
    s = make_settings(tmp_path / "state", kafka_bootstrap=kafka.settings.kafka_bootstrap, model=tiny_model,
                      **settings)
    (tmp_path / "scratch").mkdir(exist_ok=True)
    env = {**os.environ, **to_environ(s), "PYTHONPATH": os.getcwd(), "TMPDIR": str(tmp_path / "scratch")}
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]  # where a bench writes its files
    return [sys.executable, "-m", "tabloop.cli", "bench", name, *args], env


def bench(name: str, args: list[str], kafka, tiny_model, tmp_path, **settings) -> subprocess.CompletedProcess:
    command, env = bench_command(name, args, kafka, tiny_model, tmp_path, **settings)
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("name", list(BENCHES))
def test_each_bench_runs_small_and_reports_json(name, kafka, tiny_model, tmp_path):
    args, settings, check = BENCHES[name]
    out = bench(name, args, kafka, tiny_model, tmp_path, **settings)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    check(report, tmp_path / "teams") if check is check_teams else check(report)
    # Nothing left behind: the pipeline bench's broker data used to stay in /tmp after every run.
    assert list((tmp_path / "scratch").iterdir()) == []


def test_a_stopped_pipeline_bench_stops_its_broker_and_workers_and_removes_its_files(kafka, tiny_model, tmp_path):
    """`kill` (SIGTERM) of a running pipeline bench, or a CI job's timeout: it used to end at once and leave
    its broker running and its directory (hundreds of MB at the default size) behind."""
    command, env = bench_command("pipeline", ["--events", "500"], kafka, tiny_model, tmp_path)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        seen = []
        for line in proc.stderr:  # the workers are at the backlog once it reports on it
            seen.append(line)
            if "backlog:" in line:
                break
        scratch = tmp_path / "scratch"
        assert any("backlog:" in line for line in seen), "".join(seen)[-3000:]
        others = [pid for pid in processes_of(scratch) if pid != proc.pid]
        assert len(others) >= 2, "the bench's broker and worker run with its scratch dir"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert processes_of(scratch) == []
    assert list(scratch.iterdir()) == []


def test_a_failed_pipeline_bench_keeps_its_files_and_says_where(kafka, tiny_model, tmp_path):
    """A worker that cannot start (its reward spec file is missing) fails the bench; the directory with its
    log stays, named on stderr, and the broker is stopped."""
    command, env = bench_command("pipeline", ["--events", "100"], kafka, tiny_model, tmp_path)
    env["TABLOOP_REWARD_SPEC_FILE"] = str(tmp_path / "no-such-spec.yaml")
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 1 and "streams worker 0 exited" in out.stderr, out.stderr[-3000:]
    [kept] = list((tmp_path / "scratch").iterdir())
    assert f"kept {kept}" in out.stderr and (kept / "streams-0.log").exists()
    assert processes_of(kept) == []


def test_the_history_bench_refuses_too_few_events_to_time(kafka, tiny_model, tmp_path):
    """All of them would come in the first batch, which is not timed: it printed 0 rows/s."""
    out = bench("history", ["--events", "1000", "--episodes", "1000"], kafka, tiny_model, tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    batch = Settings.model_fields["history_batch_size"].default
    assert "--events 1000 is too few to time the sink" in out.stderr
    assert f"TABLOOP_HISTORY_BATCH_SIZE ({batch})" in out.stderr and f"e.g. --events {6 * batch}" in out.stderr


def test_the_pipeline_bench_refuses_more_workers_than_partitions(kafka, tiny_model, tmp_path):
    out = bench("pipeline", ["--events", "100", "--workers", "7"], kafka, tiny_model, tmp_path, topic_partitions=6)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "--workers 7: give 1 to the topics' 6 partitions" in out.stderr


def test_the_paired_ttft_difference_by_hand():
    """`bench serving --engine vllm`'s paired TTFT: the door's minus vLLM's per prompt, 3 pairs."""
    from tabloop.bench_vllm import paired_difference
    from trainer.proof.intervals import Z

    got = paired_difference([12.0, 10.0, 20.0], [10.0, 11.0, 14.0])  # differences 2, -1, 6: mean 7/3
    sd = ((2 - 7 / 3) ** 2 + (-1 - 7 / 3) ** 2 + (6 - 7 / 3) ** 2) ** 0.5 / 2 ** 0.5
    assert got["pairs"] == 3 and got["mean_ms"] == round(7 / 3, 2) and got["median_ms"] == 2.0
    assert got["low_ms"] == round(7 / 3 - Z * sd / 3 ** 0.5, 2) and got["high_ms"] == round(7 / 3 + Z * sd / 3 ** 0.5, 2)
    assert got["door_slower"] == 2
    with pytest.raises(ValueError, match="as many"):
        paired_difference([1.0], [])
