"""The documentation's picture of the status page: `python -m loadtests.assets.screenshot_demo [--seconds 60]`.

Starts `m3gate demo` on a free port (its own sample traffic on), waits the given time, opens /ui in Debian's
headless Chromium (scripts/install-chromium.sh, nothing downloaded) at 1400 px wide, the window as tall as the page,
and saves docs/img/status-page.png. Fails if the browser console shows an error. tests/ui uses the same helpers.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "img" / "status-page.png"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class DemoProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: str

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")


@contextmanager
def running_demo(traffic: bool = True, timeout: float = 90.0) -> Iterator[DemoProcess]:
    """`m3gate demo` in a child process on a free port; stopped (SIGINT, as Ctrl-C) on exit, its simulators too."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="m3gate-demo-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "gateway.cli", "demo", "--port", str(port), *([] if traffic else ["--no-traffic"])]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
    log.close()
    demo = DemoProcess(f"http://127.0.0.1:{port}", proc, log.name)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"m3gate demo exited with {proc.returncode}:\n{demo.log()[-3000:]}")
            try:
                if httpx.get(demo.url + "/ui/access", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"m3gate demo not up in {timeout} s:\n{demo.log()[-3000:]}")
            time.sleep(0.2)
        yield demo
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.returncode == 0:
            Path(log.name).unlink(missing_ok=True)


def chromium(width: int = 1400, height: int = 1000) -> Any:
    """Headless Chromium through Debian's chromedriver, its console log readable (`driver.get_log("browser")`)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--disable-extensions", "--no-first-run", "--hide-scrollbars"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=options)


def take(url: str, out: Path, width: int = 1400, min_height: int = 1000, settle_s: float = 2.0,
         fill_rows: int = 30) -> list[str]:
    """Open `url`, let it poll a few times, size the window to the whole page and save the PNG; the console's
    SEVERE entries are returned."""
    driver = chromium(width, min_height)
    try:
        driver.get(url)
        # the latest-requests table fills while the page is open (it keeps requests that arrive once it polls)
        deadline = time.monotonic() + 30
        while driver.execute_script("return document.querySelectorAll('tr.recent-request').length") < fill_rows:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        time.sleep(settle_s)
        size = 0
        for _ in range(5):  # the viewport as tall as the page, until the page stops growing
            height = driver.execute_script("return Math.ceil(document.documentElement.getBoundingClientRect().height)")
            if height == size:
                break
            size = height
            driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
                "width": width, "height": max(min_height, min(int(height), 6000)), "deviceScaleFactor": 1,
                "mobile": False})
            time.sleep(2.5)  # one more poll at the new size
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
        return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        driver.quit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="the demo's own traffic runs this long first")
    parser.add_argument("--out", type=Path, default=SCREENSHOT)
    parser.add_argument("--width", type=int, default=1400)
    args = parser.parse_args(argv)
    with running_demo() as demo:
        print(f"m3gate demo at {demo.url}; its traffic runs {args.seconds:.0f} s", flush=True)
        time.sleep(args.seconds)
        errors = take(demo.url + "/ui", args.out, width=args.width)
    print(f"screenshot: {args.out}")
    if errors:
        print("browser console errors:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
