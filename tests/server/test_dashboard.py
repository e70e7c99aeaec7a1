"""The live dashboard in headless Chromium (Debian's `chromium`), opened while requests run: it shows
a non-empty page grid with pages in use, and its numbers agree with /metrics (within the staleness
of its polling); a screenshot is saved under the test's tmp dir."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import wait_no_pages_in_use
from tests.server.test_metrics import scrape

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make install)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--window-size=1400,1000",
         "--virtual-time-budget=3000"]  # let the page poll a few times before it is captured


def chromium(url: str, profile: Path, *flags: str) -> str:
    result = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *flags, url],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


VOID = {"meta", "link", "br", "img", "input", "hr", "source", "wbr"}


class Page(HTMLParser):
    """The dumped DOM: text and data-value of every element with an id, and the grid's cells."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.texts: dict[str, str] = {}
        self.attrs_by_id: dict[str, dict[str, str]] = {}
        self.cells: list[str] = []
        self._open: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in VOID:
            return
        if "id" in attrs:
            self.attrs_by_id[attrs["id"]] = attrs
            if "data-value" in attrs:
                self.values[attrs["id"]] = attrs["data-value"]
        if (attrs.get("class") or "").startswith("pg "):
            self.cells.append(attrs["class"].split()[1])
        self._open.append(attrs.get("id", ""))

    def handle_endtag(self, tag):
        if tag not in VOID and self._open:
            self._open.pop()

    def handle_data(self, data):
        if self._open and self._open[-1]:
            self.texts[self._open[-1]] = self.texts.get(self._open[-1], "") + data


def background_load(url: str, model: str, stop: threading.Event) -> threading.Thread:
    """Requests that share a prefix (so the hit rate moves), until `stop` is set."""
    prefix = "You answer questions about the harbour timetable. " * 8

    def run(worker: int) -> None:
        i = 0
        while not stop.is_set() and i < 40:
            httpx.post(url + "/v1/completions", timeout=300, json={
                "model": model, "prompt": f"{prefix}Question {worker}.{i}: when is high tide?",
                "max_tokens": 24, "ignore_eos": True, "temperature": 0.0})
            i += 1

    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in range(6)]
    for t in threads:
        t.start()
    return threads


def test_dashboard_shows_the_pool_and_the_hit_rate_of_metrics(server, model_name, async_engine,
                                                            tmp_path):
    stop = threading.Event()
    threads = background_load(server.url, model_name, stop)
    try:
        deadline = time.monotonic() + 120
        while httpx.get(server.url + "/dashboard/stats").json()["num_requests_running"] == 0:
            assert time.monotonic() < deadline, "the load never started"
            time.sleep(0.2)
        before = scrape(server.url)
        page = Page(chromium(server.url + "/dashboard", tmp_path / "profile", "--dump-dom"))
        after = scrape(server.url)
        shot = tmp_path / "dashboard.png"
        chromium(server.url + "/dashboard", tmp_path / "profile", f"--screenshot={shot}")
    finally:
        stop.set()
        for t in threads:
            t.join(300)

    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:4] == b"\x89PNG"
    assert page.texts["status"] == "live" and int(page.attrs_by_id["page-grid"]["data-cells"]) > 0
    stats_pages = int(page.values["pages-total"])
    assert len(page.cells) == stats_pages + 1  # one cell per page, the null page included
    assert {"s2", "s3"} & set(page.cells), "no page shown in use during the load"
    in_use = int(page.texts["grid-used"]) + int(page.texts["grid-shared"])
    assert in_use == sum(c in ("s2", "s3") for c in page.cells) > 0

    # the page shows counters from between the two scrapes, and the rate they imply
    queries, hits = float(page.values["prefix-queries"]), float(page.values["prefix-hits"])
    q_name, h_name = "kvserve:prefix_cache_queries_total", "kvserve:prefix_cache_hits_total"
    assert before[q_name] <= queries <= after[q_name]
    assert before[h_name] <= hits <= after[h_name]
    shown = float(page.values["hit-rate"])
    assert queries > 0 and shown == pytest.approx(hits / queries)
    assert page.texts["hit-rate"] == f"{100 * shown:.1f}%"
    assert 0 < shown < 1

    # idle, nothing moves: the shown hit rate is exactly the one /metrics gives
    wait_no_pages_in_use(async_engine)
    idle = Page(chromium(server.url + "/dashboard", tmp_path / "profile", "--dump-dom"))
    final = scrape(server.url)
    assert float(idle.values["hit-rate"]) == pytest.approx(final[h_name] / final[q_name])
    assert idle.texts["running"] == "0" and idle.texts["grid-used"] == "0"
    assert idle.texts["report-summary"].startswith("hit rate ")  # the cache-report panel filled in


def test_with_api_keys_the_dashboards_data_needs_one(async_engine, tmp_path):
    """/dashboard (a page without data) stays open; /dashboard/stats answers only a valid key, which
    the page takes from its URL fragment (never sent to the server) and sends as a Bearer header."""
    from kvserve.server.api import build_app
    from tests.server.conftest import ServerThread

    with ServerThread(build_app(async_engine, api_keys=["sk-dash"])) as keyed:
        assert httpx.get(keyed.url + "/dashboard").status_code == 200
        assert httpx.get(keyed.url + "/dashboard/stats").status_code == 401
        stats = httpx.get(keyed.url + "/dashboard/stats", headers={"Authorization": "Bearer sk-dash"})
        assert stats.status_code == 200 and stats.json()["num_pages_total"] > 0
        without = Page(chromium(keyed.url + "/dashboard", tmp_path / "p1", "--dump-dom"))
        assert "API key needed" in without.texts["status"]
        with_key = Page(chromium(keyed.url + "/dashboard#key=sk-dash", tmp_path / "p2", "--dump-dom"))
        assert with_key.texts["status"] == "live"
        assert int(with_key.values["pages-total"]) == stats.json()["num_pages_total"]
