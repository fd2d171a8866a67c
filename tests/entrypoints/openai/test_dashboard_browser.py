"""The dashboard in a real browser: Debian's headless Chromium (driven by Selenium through
/usr/bin/chromedriver, never a downloaded browser) opens /dashboard?key=... on ``memwall serve``
over the embedded model while streaming completions run, and the page follows them: step rows
come in over time, block cells go from free to in use to cached, the running queue fills, and
the console stays free of errors. Screenshots go to $MEMWALL_DASHBOARD_SCREENSHOT (default: the
test's tmp_path/dashboard.png, plus dashboard-running.png taken mid-run and dashboard-plan.png
of the plan tab).

scripts/test installs chromium and chromium-driver when they are missing (as root, with apt-get);
without /usr/bin/chromium this skips, saying so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
KEY = "dash-key"
PREFIX = "You are a helpful assistant. Answer in one short sentence, then stop. "
# Eight requests of different lengths over four sequence slots: continuous batching refills a
# slot as soon as a request ends, where a static batch would wait for its longest.
# Lengths sized so the run spans many polls on a fast host too: at 24 tokens the whole batch
# finished between two 0.25 s polls once decode passed ~90 tok/s (CI saw only two timeline states).
MAX_TOKENS = [12, 60, 24, 48, 18, 72, 30, 36]
DOM = """return {
  conn: document.getElementById('conn').textContent,
  running: Number(document.getElementById('k-running').textContent),
  rows: document.querySelectorAll('#timeline .step-row').length,
  last: Number((document.querySelector('#timeline .step-row') || {dataset: {index: -1}}).dataset.index),
  states: [...document.querySelectorAll('#blockmap .blk')].map(c => c.dataset.state || '.').join(''),
  queued: [...document.querySelectorAll('#q-running tr[data-request]')].map(r => r.dataset.request),
  static: document.getElementById('eff-static').textContent,
  prediction: document.getElementById('pv-note').textContent,
};"""

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver):"
           " apt-get install -y chromium chromium-driver (scripts/test does it as root)")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(gguf_path, tmp_path_factory):
    """``memwall serve`` on the embedded model with --api-key, as a user starts it."""
    port, log_dir = free_port(), tmp_path_factory.mktemp("dashboard-server")
    cmd = [sys.executable, "-m", "memwall.entrypoints.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--api-key", KEY, "--num-kv-blocks", "48", "--max-model-len", "512",
           "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--no-show-progress",
           "--threads", "1"]  # one core for the engine, one for the browser (2-core CI hosts)
    log = open(log_dir / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (log_dir / "server.log").read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "memwall serve did not become healthy"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


@pytest.fixture
def browser():
    from selenium import webdriver  # a test dependency (pyproject's test extra)
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1500,1500"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


def screenshot_path(tmp_path: Path) -> Path:
    path = Path(os.environ.get("MEMWALL_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def stream_completion(url: str, max_tokens: int, question: int, errors: list) -> None:
    body = {"prompt": PREFIX + f"Question {question}: what colour is the sky at noon?",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200, r.read()
            for _ in r.iter_lines():
                pass
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def wait_for(driver, check, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        dom = driver.execute_script(DOM)
        if check(dom):
            return dom
        assert time.monotonic() < deadline, f"the page never got there: {dom}"
        time.sleep(0.1)


def test_plan_tab_renders_the_planner_answer(served, browser, tmp_path):
    _, url = served
    from selenium.webdriver.common.by import By

    browser.get(f"{url}/dashboard?key={KEY}")
    browser.find_element(By.ID, "tab-btn-plan").click()
    browser.find_element(By.ID, "plan-submit").click()
    deadline = time.monotonic() + 30
    while not browser.find_elements(By.CSS_SELECTOR, "#plan-result tr"):
        status = browser.find_element(By.ID, "plan-status").text
        assert time.monotonic() < deadline, f"no plan table came: {status!r}"
        time.sleep(0.2)
    rows = browser.find_elements(By.CSS_SELECTOR, "#plan-result tr")
    assert rows and all(len(r.find_elements(By.TAG_NAME, "td")) == 2 for r in rows)
    keys = [r.find_elements(By.TAG_NAME, "td")[0].text for r in rows]
    assert "model" in {k.split(".")[0] for k in keys}, keys  # plan_json's document, key by key
    shot = screenshot_path(tmp_path)
    browser.save_screenshot(str(shot.with_name(shot.stem + "-plan.png")))
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_dashboard_follows_live_requests(served, browser, tmp_path):
    proc, url = served
    shot = screenshot_path(tmp_path)
    browser.get(f"{url}/dashboard?key={KEY}")
    first = wait_for(browser, lambda d: d["conn"] == "live" and len(d["states"]) == 48)
    assert set(first["states"]) == {"."} and first["rows"] == 0  # a fresh server: all free
    assert "key=" not in browser.current_url  # the cookie carries it from here on

    errors: list = []
    threads = [threading.Thread(target=stream_completion, args=(url, n, i, errors))
               for i, n in enumerate(MAX_TOKENS)]
    for t in threads:
        t.start()
    seen, running_shot, shot_taken = [], shot.with_name(shot.stem + "-running.png"), False
    while any(t.is_alive() for t in threads):
        dom = browser.execute_script(DOM)
        seen.append(dom)
        if dom["running"] >= 3 and dom["rows"] >= 6 and not shot_taken:
            shot_taken = browser.save_screenshot(str(running_shot))
        time.sleep(0.05)
    assert not errors, errors
    # after the last step: no block held, the prompts' full blocks kept in the prefix cache
    final = wait_for(browser, lambda d: d["running"] == 0 and "U" not in d["states"]
                     and d["rows"] > 0, timeout=10)
    time.sleep(0.6)  # one more event: the batching figures of the finished trace
    final = browser.execute_script(DOM)
    browser.save_screenshot(str(shot))

    lasts = sorted({d["last"] for d in seen if d["last"] >= 0})
    assert len(lasts) >= 3, f"the timeline did not grow step by step: {lasts}"
    assert final["rows"] >= max(MAX_TOKENS) and final["last"] >= lasts[-1]
    assert any("U" in d["states"] or "S" in d["states"] for d in seen), "no block was ever in use"
    assert len({d["states"] for d in seen}) >= 2, "the block map never changed while running"
    assert "C" in final["states"]  # finished prompts' blocks stay cached
    assert max(len(d["queued"]) for d in seen) >= 2 and all(q.startswith("cmpl-")
                                                             for d in seen for q in d["queued"])
    assert final["static"].endswith("%")
    # the planner's figure for this model at the live batch (or, uncalibrated, how to get one)
    assert any(d["prediction"].startswith("decode at batch") or "--calibrate" in d["prediction"]
               for d in seen + [final]), [d["prediction"] for d in seen[-3:]]

    logs = browser.get_log("browser")
    assert not [e for e in logs if e["level"] == "SEVERE"], logs
    assert shot.stat().st_size > 10_000

    # The page still open (its event stream too), the server stops at once when told to.
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=20)
    assert time.monotonic() - started < 20
