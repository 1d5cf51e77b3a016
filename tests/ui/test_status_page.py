"""The status page (/ui) and the contract report in a real browser: Debian's headless Chromium driven by Selenium
through Debian's chromedriver (scripts/install-chromium.sh; nothing is downloaded at run time).

Against simulated pools and a real gateway process: no console errors; every pool and replica shown; a killed
replica turns unavailable on the page within two health intervals; a bad config edit shows its error and line; a
request's waterfall appears; the admin key is required, and asking for it logs no error. Screenshots go to
loadtests/results/ui/ (printed).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.cli.contract import write_contract
from gateway.cli.launcher import GatewayProcess, start_gateway
from policies.config import GatewayConfig
from policies.contract import build_contract, check, observed_from_samples
from pools.sim.launcher import SimProcess, running_sims

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180), pytest.mark.tools("chromium", "chromedriver")]

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "loadtests" / "results" / "ui"
ADMIN_KEY = "ui-test-admin-key-7d1e"
HEALTH_INTERVAL_S = 1.0
MODEL = "MiniMaxAI/MiniMax-M3"


def gateway_config(sims: list[SimProcess]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "pools": [
            {"name": "interactive", "max_model_len": 32768, "endpoints": [sims[0].url, sims[1].url]},
            {"name": "repository", "max_model_len": 131072, "endpoints": [sims[2].url]},
        ],
        "server": {"health_interval_s": HEALTH_INTERVAL_S},
        "admin": {"api_key": ADMIN_KEY, "watch_config": True},
        "capacity": {"interval_s": 0.5, "window_s": 2, "scale_down_stabilization_s": 2},
        "traffic": {"classes": {
            "interactive": {"priority": 0, "targets": {"ttft_ms": {"p50": 200, "p95": 1000}, "tpot_ms": {"p95": 50}}},
            "repository": {"priority": 1, "targets": {"ttft_ms": {"p95": 10000}}},
            "batch": {"priority": 9, "background": True},
        }},
    }


class Page:
    """One headless Chromium on the gateway's /ui."""

    def __init__(self, driver: Any, base: str) -> None:
        self.driver = driver
        self.base = base

    def wait(self, what: str, predicate: Callable[[], Any], timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = predicate()
            except Exception:  # noqa: BLE001 - the DOM is being redrawn under us
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                self.shot(f"timeout-{what.replace(' ', '-')}")
                raise AssertionError(f"page: {what} not seen in {timeout} s")
            time.sleep(0.05)

    def css(self, selector: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, selector)

    def attrs(self, selector: str, name: str) -> list[str | None]:
        """An attribute of every element matching `selector`, read in one script run: the page redraws every poll,
        and an element found by one WebDriver call can be gone (stale) by the next."""
        return self.driver.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.getAttribute(arguments[1]));",
            selector, name)

    def texts(self, selector: str) -> list[str]:
        """The rendered text of every element matching `selector`, in one script run (see `attrs`)."""
        return self.driver.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.innerText);", selector)

    def shot(self, name: str) -> Path:
        SHOTS.mkdir(parents=True, exist_ok=True)
        path = SHOTS / f"{name}.png"
        self.driver.save_screenshot(str(path))
        print(f"screenshot: {path}")
        return path

    def console_errors(self) -> list[str]:
        return [e["message"] for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]


def new_driver() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER or "chromedriver"), options=options)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, list[SimProcess]]]:
    specs = [{"max_model_len": 32768, "extra_args": ["--kv-blocks", "2048"]},
             {"max_model_len": 32768, "extra_args": ["--kv-blocks", "2048"]},
             {"max_model_len": 131072, "extra_args": ["--kv-blocks", "4096"]}]
    with running_sims(specs) as sims:
        gw = start_gateway(gateway_config(sims), workdir=tmp_path_factory.mktemp("ui-gateway"))
        try:
            yield gw, sims
        finally:
            gw.stop()


@pytest.fixture(scope="module")
def page(stack: tuple[GatewayProcess, list[SimProcess]]) -> Iterator[Page]:
    gw, _ = stack
    driver = new_driver()
    try:
        # The key goes into this tab's sessionStorage before the page's script runs (as the login form puts it).
        driver.get(gw.url + "/ui/static/ui.css")
        driver.execute_script("sessionStorage.setItem('m3gate.adminKey', arguments[0])", ADMIN_KEY)
        driver.get_log("browser")  # drained: a bare stylesheet's tab asks for /favicon.ico (404); /ui does not
        driver.get(gw.url + "/ui")
        yield Page(driver, gw.url)
    finally:
        driver.quit()


def chat(base: str, stream: bool = True, headers: dict[str, str] | None = None) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "show me the stages"}], "max_tokens": 24,
            "stream": stream}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers, timeout=30) as resp:
        assert resp.status_code == 200
        for _ in resp.iter_bytes():
            pass


def test_every_pool_and_replica_is_shown(page: Page, stack: tuple[GatewayProcess, list[SimProcess]]) -> None:
    _, sims = stack
    page.wait("three available replicas", lambda: page.attrs("tr.replica", "data-state").count("available") == 3)
    assert set(page.attrs("tr.replica", "data-replica")) == {s.url for s in sims}
    assert set(page.attrs("div.pool", "data-pool")) == {"interactive", "repository"}
    assert "ceiling 32K tokens" in page.texts("#pool-interactive")[0]
    assert set(page.attrs("tr.traffic-class", "data-class")) == {"interactive", "repository", "batch"}
    assert page.texts("#batch") == ["No active batch jobs."]  # the Batch API's panel
    # each pool's capacity signal: "sizing…" for the first window, then the replicas running, and once the
    # stabilization window has passed the replicas it needs (idle: the minimum)
    page.wait("each pool's capacity signal", lambda: page.attrs("#pool-interactive span.capacity", "data-desired")
              == ["1"] and page.attrs("#pool-repository span.capacity", "data-desired") == ["1"], timeout=15)
    assert "needs 1" in page.texts("#pool-interactive span.capacity")[0]
    assert page.console_errors() == []


def test_a_pools_background_lane_is_shown(page: Page, stack: tuple[GatewayProcess, list[SimProcess]]) -> None:
    chat(stack[0].url, headers={"x-m3gate-class": "batch"})
    page.wait("the background lane of the pool", lambda: page.attrs("#pool-interactive span.background", "data-class")
              == ["batch"])
    # in flight / window; one success grew it from one to two
    page.wait("the lane's window", lambda: page.texts("#pool-interactive span.background") == ["batch: 0/2 window"])
    assert page.console_errors() == []


def test_a_requests_waterfall_appears(page: Page) -> None:
    page.wait("the page polling", lambda: page.css("#live")[0].text == "live")
    time.sleep(0.3)  # the ring records requests that arrive once the page has polled
    for _ in range(3):
        chat(page.base)
    # the stage titles of the newest request with at least three, read in one script run (the page redraws)
    titles = page.wait("a request with its stages", lambda: page.driver.execute_script(
        "for (const r of document.querySelectorAll('tr.recent-request')) {"
        "  const t = Array.from(r.querySelectorAll('.waterfall span')).map(s => s.getAttribute('title'));"
        "  if (t.length >= 3) return t; }"
        "return null;"))
    stages = {title.split(":")[0] for title in titles}
    assert {"gateway", "engine queue + prefill", "decode"} <= stages, stages
    page.wait("TTFT percentiles for the class", lambda: any(
        "ms" in text for text in page.texts('tr.traffic-class[data-class="interactive"] td')[6:8]))
    page.shot("status-page")
    assert page.console_errors() == []


def test_a_killed_replica_turns_unavailable_within_two_health_intervals(
        page: Page, stack: tuple[GatewayProcess, list[SimProcess]]) -> None:
    _, sims = stack
    victim = sims[1]
    row = f'tr.replica[data-replica="{victim.url}"]'
    page.wait("the victim available", lambda: page.css(row)[0].get_attribute("data-state") == "available")
    killed = time.monotonic()
    victim.kill()
    page.wait("the killed replica unavailable", lambda: page.css(row)[0].get_attribute("data-state") != "available",
              timeout=2 * HEALTH_INTERVAL_S)
    took = time.monotonic() - killed
    print(f"killed replica shown {page.attrs(row, 'data-state')} after {took:.2f} s "
          f"(health interval {HEALTH_INTERVAL_S} s)")
    page.shot("replica-killed")
    assert page.console_errors() == []


def test_a_bad_config_edit_shows_its_error_and_line(page: Page, stack: tuple[GatewayProcess, list[SimProcess]]) -> None:
    gw, _ = stack
    good = gw.config_path.read_text()
    try:
        gw.config_path.write_text(good.replace("max_model_len: 131072", "max_model_len: -5"))
        status = page.wait("the reload rejected", lambda: page.texts('#reload-status[data-ok="false"]'))
        problems = page.wait("the problem", lambda: page.texts(".reload-problem"))
        text = " ".join(problems)
        assert "max_model_len" in text and "line" in text, text
        assert "REJECTED" in status[0]
        page.shot("config-rejected")
    finally:
        gw.config_path.write_text(good)
    page.wait("the good config back", lambda: page.css('#reload-status[data-ok="true"]'))
    assert page.console_errors() == []


def test_the_admin_key_is_required(stack: tuple[GatewayProcess, list[SimProcess]]) -> None:
    gw, _ = stack
    assert httpx.get(gw.url + "/ui/state").status_code == 401
    assert httpx.get(gw.url + "/ui/state", headers={"authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(gw.url + "/ui/state", headers={"authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200
    driver = new_driver()
    try:
        p = Page(driver, gw.url)
        driver.get(gw.url + "/ui")
        p.wait("the key form", lambda: p.css("#login")[0].is_displayed())
        assert not p.css("#main")[0].is_displayed()
        p.shot("login")
        p.css("#key")[0].send_keys("not-the-key")
        p.css("#login button")[0].click()
        p.wait("the refusal", lambda: p.css("#login-error")[0].text)
        assert not p.css("#main")[0].is_displayed()
        p.css("#key")[0].send_keys(ADMIN_KEY)
        p.css("#login button")[0].click()
        p.wait("the page", lambda: p.css("#main")[0].is_displayed() and p.css("tr.replica"))
        assert ADMIN_KEY not in driver.current_url
        # The page asked GET /ui/access (always a 200) before its first poll and for each typed key: no refused
        # request, so nothing in the console, a wrong key included.
        assert p.console_errors() == []
    finally:
        driver.quit()


def test_the_contract_report_renders(tmp_path: Path) -> None:
    config = GatewayConfig.model_validate({
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 32768, "endpoints": ["http://127.0.0.1:1"],
                   "launch": {"hardware": "h200", "variant": "mxfp8", "tensor_parallel_size": 4,
                              "speculative_decoding": True}}],
        "traffic": {"classes": {"interactive": {"targets": {"ttft_ms": {"p50": 100, "p95": 400}}}}},
    })
    samples = {"interactive": {"ttft": [0.05, 0.08, 0.09, 0.3, 0.9] * 20}}
    stages = {"interactive": {"gateway queue": 0.01, "engine queue + prefill": 0.8, "decode": 2.0}}
    contract = check(build_contract(config), observed_from_samples(samples, stages), "synthetic samples")
    paths = write_contract(contract, tmp_path)
    driver = new_driver()
    try:
        p = Page(driver, "")
        driver.get(paths["html"].as_uri())
        assert "FAIL" in p.css("body")[0].text and "EAGLE3" in p.css("body")[0].text
        assert len(p.css("svg")) >= 2 and p.css("span.FAIL") and p.css("span.PASS")
        p.shot("contract")
        assert p.console_errors() == []
    finally:
        driver.quit()
