"""The dashboard in headless Chromium (Debian's package): no console errors, no outside requests, and
charts that show the fixture's numbers."""

from __future__ import annotations

import shutil
from collections import defaultdict
from urllib.parse import urlparse

import pytest

from streams.history.sql import HistoryServer
from tests.history_fixture import analytics_fixture, expected_analytics, insert_events, new_store

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install chromium (CI installs it)")
TOKEN = "tlh_dashboard_test"


@pytest.fixture(scope="module")
def served():
    fx = analytics_fixture(seed=3, per_day=80, days=5)
    store = new_store()
    insert_events(store, fx.events)
    server = HistoryServer(store, TOKEN, "127.0.0.1", 0).start()
    yield server, expected_analytics(fx)
    server.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        yield b
        b.close()


def open_page(browser, url: str):
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning")
            else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    hosts: set[str] = set()
    page.on("request", lambda r: hosts.add(urlparse(r.url).netloc) if r.url.startswith("http") else None)
    page.goto(url)
    page.wait_for_selector("body[data-ready]", timeout=30_000)
    return page, problems, hosts


def marks(page, selector: str) -> dict[tuple[str, str], float]:
    found = page.eval_on_selector_all(
        selector, "els => els.map(e => [e.dataset.series, e.dataset.x, e.dataset.value])")
    return {(s, x): float(v) for s, x, v in found}


def test_dashboard_draws_the_fixture_numbers(served, browser):
    server, want = served
    page, problems, hosts = open_page(browser, f"{server.url}/#token={TOKEN}")
    try:
        assert page.get_attribute("body", "data-ready") == "true", page.inner_text("#status")
        assert problems == []
        assert hosts == {f"127.0.0.1:{server.port}"}  # nothing from a CDN or anywhere else
        assert "token" not in page.url  # taken out of the address bar

        acceptance = {(f"v{v}", d): r["acceptance_rate"] for (v, d), r in want["acceptance_by_version"].items()
                      if v is not None and r["acceptance_rate"] is not None}
        assert marks(page, "#acceptance-chart circle[data-series]") == acceptance
        assert len({s for s, _ in acceptance}) == 4 and len(acceptance) >= 10

        shown, accepted = defaultdict(int), defaultdict(int)
        for (day, _, _), r in want["shown_vs_accepted"].items():
            shown[day] += r["shown"]
            accepted[day] += r["accepted"]
        bars = marks(page, "#shown-chart rect[data-series]")
        assert bars == {**{("shown", d): n for d, n in shown.items()}, **{("accepted", d): n for d, n in accepted.items()}}

        latency = {(q, d): r[f"latency_{q}"] for d, r in want["latency_by_day"].items() for q in ("p50", "p90", "p99")}
        assert marks(page, "#latency-chart circle[data-series]") == latency

        reward = {(f"v{v}", d): r["reward_mean"] for (v, d), r in want["reward_by_version"].items() if v is not None}
        assert marks(page, "#reward-chart circle[data-series]") == reward

        tiles = page.inner_text("#tiles")
        assert f"{sum(shown.values()):,}" in tiles and f"{sum(accepted.values()):,}" in tiles
        hidden = sum(r["gate_hidden"] for r in want["shown_vs_accepted"].values())
        assert hidden > 0 and f"{hidden:,}\nhidden by the show-gate" in tiles
        # the values behind each chart are on the page as a table too
        assert page.locator("#latency-chart details.values tbody tr").count() == len(want["latency_by_day"])
    finally:
        page.close()


def test_dashboard_without_the_token_asks_for_it(served, browser):
    server, _ = served
    page, problems, _ = open_page(browser, f"{server.url}/#token=wrong")
    try:
        assert page.get_attribute("body", "data-ready") == "login"
        assert page.is_visible("#login") and "not accepted" in page.inner_text("#status")
        # the 401 the page got is the only complaint Chromium logs
        assert all("401" in p for p in problems), problems
        page.fill("#token", TOKEN)
        page.click("#login button")
        page.wait_for_selector("body[data-ready=true]", timeout=30_000)
        assert page.locator("#acceptance-chart circle").count() > 0
    finally:
        page.close()
