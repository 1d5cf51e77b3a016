"""`m3gate demo`'s status page in a real browser (Debian's headless Chromium through Selenium): the demo's own sample
traffic reaches every section without any client of ours, the history charts draw and grow, every figure says what
it is, and the browser console stays clean. The demo runs as the user runs it, a child process on a free port."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from loadtests.assets.screenshot_demo import DemoProcess, chromium, running_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180), pytest.mark.tools("chromium", "chromedriver")]

CLASSES = ("interactive", "repository", "extended")  # the foreground classes: streams, TTFT and TPOT targets
ALL_CLASSES = (*CLASSES, "batch")  # and the Batch API's built-in class (non-streamed: no TTFT)
POOLS = ("interactive", "repository", "extended")


class DemoPage:
    def __init__(self, driver: Any, demo: DemoProcess) -> None:
        self.driver = driver
        self.demo = demo

    def js(self, script: str, *args: Any) -> Any:
        """One script run: the page redraws every poll, so an element found by one WebDriver call can be gone by the
        next; reading everything in one run avoids that."""
        return self.driver.execute_script(script, *args)

    def wait(self, what: str, predicate: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = predicate()
            except Exception:  # noqa: BLE001 - a row being redrawn, a cell not yet filled
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"demo page: {what} not seen in {timeout} s")
            time.sleep(0.25)

    def console_errors(self) -> list[str]:
        return [e["message"] for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]


@pytest.fixture(scope="module")
def demo() -> Iterator[DemoProcess]:
    with running_demo() as process:
        yield process


@pytest.fixture(scope="module")
def page(demo: DemoProcess) -> Iterator[DemoPage]:
    driver = chromium(1400, 1000)
    try:
        driver.get(demo.url + "/ui")
        yield DemoPage(driver, demo)
    finally:
        driver.quit()


def test_the_banner_says_the_sample_traffic_is_on(demo: DemoProcess) -> None:
    assert "Sample traffic: ON" in demo.log() and "--no-traffic" in demo.log()


def test_the_demos_traffic_reaches_every_section(page: DemoPage) -> None:
    page.wait("three available replicas", lambda: page.js(
        "return Array.from(document.querySelectorAll('tr.replica')).map(r => r.dataset.state);") == ["available"] * 3,
        timeout=20)
    # every foreground class's TTFT p95 (the repository prompt and the long document take a few simulated seconds of
    # prefill), and the demo's batch jobs admitted in the batch class
    def rows() -> dict[str, list[str]]:
        return {cells[0]: cells for cells in page.js(
            "return Array.from(document.querySelectorAll('tr.traffic-class')).map("
            "  r => Array.from(r.querySelectorAll('td')).map(c => c.innerText));")}

    page.wait("a TTFT p95 for every foreground class", lambda: (lambda r: set(r) == set(ALL_CLASSES) and all(
        r[c][7] not in ("—", "") for c in CLASSES))(rows()), timeout=60)
    page.wait("the demo's batch requests admitted", lambda: float(rows()["batch"][4].split("/")[0]) > 0, timeout=60)
    pools = page.wait("waterfalls of the interactive and a long-prompt pool", lambda: (lambda seen: seen if (
        "interactive" in seen and {"repository", "extended"} & seen) else None)(set(page.js(
            "return Array.from(document.querySelectorAll('tr.recent-request')).map(r => r.dataset.pool);"))),
        timeout=40)
    assert pools <= set(POOLS)
    session = page.wait("an agent session with tool and think waits", lambda: page.js(
        "for (const r of document.querySelectorAll('tr.agent-session')) {"
        "  const c = Array.from(r.querySelectorAll('td')).map(td => td.innerText);"
        "  if (c[2] === 'header' && /\\((\\d+)\\)/.exec(c[6])[1] > 0 && /\\((\\d+)\\)/.exec(c[7])[1] > 0) return c; }"
        "return null;"), timeout=60)
    assert int(session[3]) >= 4  # two tool calls, the final answer, the follow-up
    assert page.js("return document.querySelectorAll('#history svg.chart').length;") == 4 * 3 + 2 * 3
    assert page.console_errors() == []


def test_the_history_charts_draw_and_update(page: DemoPage) -> None:
    def drawn() -> dict[str, int]:
        return page.js("const out = {}; for (const s of document.querySelectorAll('svg.chart'))"
                       "  out[s.dataset.series] = Number(s.dataset.points) * (s.querySelector('path, circle') ? 1 : 0);"
                       "return out;")

    first = page.wait("lines in the interactive class's and pool's charts", lambda: (lambda d: d if (
        d.get("interactive-ttft", 0) >= 1 and d.get("interactive-admitted", 0) >= 1
        and d.get("interactive-in-flight", 0) >= 1) else None)(drawn()), timeout=30)
    assert set(first) == {f"{c}-{m}" for c in ALL_CLASSES for m in ("ttft", "tpot", "admitted")} | {
        f"{p}-{m}" for p in POOLS for m in ("in-flight", "kv")}
    # the gateway samples every 5 s and the page asks only for the new points: the lines grow
    later = page.wait("a new point", lambda: (lambda d: d if d["interactive-in-flight"] > first[
        "interactive-in-flight"] else None)(drawn()), timeout=15)
    assert later["interactive-admitted"] >= first["interactive-admitted"]
    targets = page.js("return Array.from(document.querySelectorAll('svg.chart')).filter("
                      "  s => s.querySelector('line.chart-target')).map(s => s.dataset.series);")
    # the demo sets both targets of the foreground classes; the batch class has its built-in ttft_target_s only
    assert set(targets) == {f"{c}-{m}" for c in CLASSES for m in ("ttft", "tpot")} | {"batch-ttft"}
    assert page.console_errors() == []


def test_every_figure_says_what_it_is(page: DemoPage) -> None:
    page.wait("requests and sessions on the page", lambda: page.js(
        "return document.querySelector('tr.recent-request') && document.querySelector('tr.agent-session');"),
        timeout=60)
    untitled = page.js(
        "const bare = [];"
        "for (const el of document.querySelectorAll('#main td, #main th, .chart-card, .chart-value, .pool-head > *,"
        "    .waterfall span, .legend span, #live, #updated, #reload-status > span'))"
        "  if (!el.getAttribute('title')) bare.push(el.outerHTML.slice(0, 120));"
        "for (const s of document.querySelectorAll('svg.chart')) if (!s.querySelector('title')) bare.push(s.dataset.series);"
        "return bare;")
    assert untitled == []
    assert page.console_errors() == []


def test_no_traffic_keeps_the_demo_quiet() -> None:
    with running_demo(traffic=False) as quiet:
        time.sleep(4.0)  # the sample traffic would have sent every kind by now
        state = httpx.get(quiet.url + "/ui/state", timeout=10).json()
        assert "Sample traffic: OFF" in quiet.log()
    assert all(row["requests_total"] == 0 for row in state["latency"]["classes"].values())
    assert state["sessions"]["open"] == [] and state["recent"] == []
