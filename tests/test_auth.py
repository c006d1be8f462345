"""API keys: stored hashed, checked in constant time, seen across processes; rate limits worked by hand."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest

from infra.auth import KeyStore, KeyStoreError, Principal, RateLimiter


@pytest.fixture
def path(tmp_path):
    return tmp_path / "conf" / "keys.json"


def test_add_verify_revoke(path):
    store = KeyStore(path)
    assert not path.exists() and store.list() == []
    key = store.add("proj-a", "alice", rate_per_minute=30)
    prefix, key_id, secret = key.split("_", 2)
    assert prefix == "tlk" and len(key_id) == 8 and int(key_id, 16) >= 0 and len(secret) == 43
    principal = store.verify(key)
    assert principal == Principal(key_id, "proj-a", "alice", 30, principal.created_at)
    assert principal.created_at.endswith("+00:00")
    other = store.add("proj-a", "bob")
    assert store.verify(other).rate_per_minute is None
    assert [p.user_id for p in store.list()] == ["alice", "bob"]
    assert store.revoke(key_id) is True
    assert store.verify(key) is None and store.verify(other) is not None
    assert store.revoke(key_id) is False and store.revoke("nonsense") is False


def test_the_file_holds_no_secret_and_is_0600(path):
    store = KeyStore(path)
    key = store.add("p", "u")
    _, key_id, secret = key.split("_", 2)
    text = path.read_text()
    assert secret not in text and key not in text
    entry = json.loads(text)["keys"][key_id]
    assert entry["project_id"] == "p" and len(entry["sha256"]) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    store.revoke(key_id)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_the_file_is_0600_whatever_the_umask(path):
    old = os.umask(0)
    try:
        KeyStore(path).add("p", "u")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_wrong_secret_for_a_real_key_id_is_rejected(path):
    store = KeyStore(path)
    key = store.add("p", "u")
    prefix, key_id, secret = key.split("_", 2)
    flipped = ("A" if secret[-1] != "A" else "B")
    assert store.verify(f"{prefix}_{key_id}_{secret[:-1]}{flipped}") is None
    assert store.verify(f"{prefix}_{key_id}_{'x' * 43}") is None
    unknown_id = "0" * 8 if key_id != "0" * 8 else "1" * 8
    assert store.verify(f"{prefix}_{unknown_id}_{secret}") is None


@pytest.mark.parametrize("presented", [
    "", "tlk_", "tlk__", "Bearer tlk_0123abcd_" + "a" * 43, "tlk_0123ABCD_" + "a" * 43, "tlk_0123abc_" + "a" * 43,
    "tlk_0123abcd_" + "a" * 42, "tlk_0123abcd_" + "a" * 44, "tlk_0123abcd_" + "a" * 42 + "=",
    "tlk_0123abcd_" + "a" * 42 + "\n", "xyz_0123abcd_" + "a" * 43, "tlk_0123abcd_" + "a" * 42 + "é",
    "tlk_" * 10_000, None, b"tlk_0123abcd_" + b"a" * 43, 12345,
])
def test_malformed_keys_are_none(path, presented):
    store = KeyStore(path)
    store.add("p", "u")
    assert store.verify(presented) is None


@pytest.mark.parametrize("field,project,user,words", [
    ("project", "", "u", "non-empty"),
    ("user", "p", "", "non-empty"),
    ("project", "p" * 129, "u", "at most 128"),
    ("user", "p", "u\n", "control character"),
    ("project", "a\x00b", "u", "control character"),
    ("user", "p", "evil\u202etxt", "control character"),  # a right-to-left override would spoof logs
    ("project", None, "u", "non-empty string"),
])
def test_bad_names_are_refused_by_field(path, field, project, user, words):
    store = KeyStore(path)
    with pytest.raises(ValueError) as err:
        store.add(project, user)
    assert str(err.value).startswith(field) and words in str(err.value)
    assert not path.exists()


def test_names_up_to_128_characters_and_any_script_are_fine(path):
    store = KeyStore(path)
    assert store.verify(store.add("p" * 128, "Zoë 李")).user_id == "Zoë 李"


@pytest.mark.parametrize("rate", [0, -1, 1.5, True, "60"])
def test_bad_rate_is_refused(path, rate):
    with pytest.raises(ValueError, match="rate_per_minute"):
        KeyStore(path).add("p", "u", rate_per_minute=rate)


def test_a_second_store_sees_what_the_first_writes(path):
    server, cli = KeyStore(path), KeyStore(path)
    key = cli.add("p", "u")
    assert server.verify(key).user_id == "u"  # added while the server runs: effective at once
    cli.revoke(key.split("_")[1])
    assert server.verify(key) is None
    again = cli.add("p", "u2")
    assert server.verify(again).user_id == "u2"


def test_writers_in_two_stores_do_not_lose_each_others_keys(path):
    one, two = KeyStore(path), KeyStore(path)
    a = one.add("p", "a")
    b = two.add("p", "b")  # two had never re-read the file: it must not write over a
    c = one.add("p", "c")
    fresh = KeyStore(path)
    assert all(fresh.verify(k) is not None for k in (a, b, c))


def test_a_broken_file_is_an_error_at_start_and_keeps_old_keys_while_serving(path, caplog):
    store = KeyStore(path)
    key = store.add("p", "u")
    path.write_text("{not json")
    with pytest.raises(KeyStoreError, match=str(path)):
        KeyStore(path)
    with caplog.at_level(logging.ERROR, logger="tabloop.auth"):
        assert store.verify(key) is not None
    assert str(path) in caplog.text
    with pytest.raises(KeyStoreError):  # and nothing writes over it
        store.add("p", "v")
    path.write_text(json.dumps({"version": 1, "keys": {"abcdef01": {"sha256": "x"}}}))
    with pytest.raises(KeyStoreError, match="abcdef01"):
        KeyStore(path)


# -- rate limits ------------------------------------------------------------------


def test_sixty_a_minute_with_burst_two():
    limiter = RateLimiter(60, burst=2)
    assert limiter.check("k", now=0.0) == 0.0
    assert limiter.check("k", now=0.0) == 0.0
    assert limiter.check("k", now=0.0) == pytest.approx(1.0)   # empty; one token a second
    assert limiter.check("k", now=0.5) == pytest.approx(0.5)   # half a token by now
    assert limiter.check("k", now=1.0) == 0.0
    assert limiter.check("k", now=1.0) == pytest.approx(1.0)
    assert limiter.check("k", now=3.5) == 0.0                  # 2.5 s: two tokens (the most it holds), one used
    assert limiter.check("k", now=3.5) == 0.0
    assert limiter.check("k", now=3.5) == pytest.approx(1.0)


def test_without_burst_a_bucket_holds_a_minute():
    limiter = RateLimiter(6)  # one token every 10 s, six at most
    assert [limiter.check("k", now=0.0) for _ in range(6)] == [0.0] * 6
    assert limiter.check("k", now=0.0) == pytest.approx(10.0)
    assert limiter.check("k", now=4.0) == pytest.approx(6.0)
    assert limiter.check("k", now=10.0) == 0.0
    assert limiter.check("k", now=1000.0) == 0.0
    assert [limiter.check("k", now=1000.0) for _ in range(6)] == [0.0] * 5 + [pytest.approx(10.0)]


def test_keys_have_their_own_buckets_and_rates():
    limiter = RateLimiter(60, burst=1)
    assert limiter.check("a", now=0.0) == 0.0
    assert limiter.check("b", now=0.0) == 0.0
    assert limiter.check("a", now=0.0) == pytest.approx(1.0)
    assert limiter.check("c", per_minute=120, now=0.0) == 0.0
    assert limiter.check("c", per_minute=120, now=0.0) == pytest.approx(0.5)
    assert limiter.check("c", per_minute=120, now=0.5) == 0.0


def test_a_clock_that_goes_back_gives_nothing():
    limiter = RateLimiter(60, burst=1)
    assert limiter.check("k", now=10.0) == 0.0
    assert limiter.check("k", now=5.0) == pytest.approx(6.0)   # still a second after 10.0
    assert limiter.check("k", now=11.0) == 0.0


def test_the_default_clock_is_monotonic():
    limiter = RateLimiter(1, burst=1)
    assert limiter.check("k") == 0.0
    assert 59.0 < limiter.check("k") <= 60.0


@pytest.mark.parametrize("args", [(0,), (-5,), (60, 0), (1.5,), (60, True)])
def test_bad_limits_are_refused(args):
    with pytest.raises(ValueError):
        RateLimiter(*args)
    with pytest.raises(ValueError, match="per_minute"):
        RateLimiter(60).check("k", per_minute=0)


def test_many_keys_do_not_pile_up():
    limiter = RateLimiter(60, burst=1)
    for i in range(RateLimiter._PRUNE_AT + 5):
        limiter.check(f"k{i}", now=float(i) * 10)  # each bucket is full again 1 s after its use
    assert len(limiter._buckets) < 10
