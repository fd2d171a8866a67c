"""GET /dashboard and its data: behind the API key (header, ?key= or the cookie that sets), an
SSE stream whose events carry the engine core's steps and block map across the core process,
the plan and prediction endpoints, and a shutdown that an open stream cannot hold.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import types

import httpx
import pytest

from memwall.core.step_record import StepRecord
from memwall.entrypoints.openai.dashboard.payload import throughput

API_KEY = "test-key"  # the shared server's (conftest.py)

PAGES = ["/dashboard", "/dashboard/static/app.js", "/dashboard/static/style.css",
         "/dashboard/api/snapshot"]


def sse_events(response: httpx.Response):
    """The JSON events of an open SSE response, as they come."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[len("data: "):])


@pytest.mark.parametrize("path", PAGES + ["/dashboard/api/events"])
def test_without_the_key_401_in_the_api_error_shape(server, path):
    for params in ({}, {"key": "wrong"}):
        r = httpx.get(f"{server.url}{path}", params=params, timeout=10)
        assert r.status_code == 401
        error = r.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert "/dashboard?key=" in error["message"]


def test_with_the_key_by_query_header_or_cookie(server):
    first = httpx.get(f"{server.url}/dashboard", params={"key": API_KEY}, timeout=10)
    assert first.status_code == 200 and first.headers["content-type"].startswith("text/html")
    assert "/dashboard/static/app.js" in first.text
    cookie = first.headers["set-cookie"]
    assert "memwall_dashboard_key=" in cookie and "HttpOnly" in cookie and "Path=/dashboard" in cookie
    jar = {"memwall_dashboard_key": first.cookies["memwall_dashboard_key"]}
    for path in PAGES:
        assert httpx.get(f"{server.url}{path}", cookies=jar, timeout=10).status_code == 200, path
        assert httpx.get(f"{server.url}{path}", headers=server.headers, timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/dashboard/static/secret.py", cookies=jar,
                     timeout=10).status_code == 404


def test_the_api_itself_still_takes_the_header_only(server):
    jar = {"memwall_dashboard_key": API_KEY}
    assert httpx.get(f"{server.url}/v1/models", params={"key": API_KEY}, cookies=jar,
                     timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers=server.headers, timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200  # no key, as before


def test_events_carry_steps_and_the_block_map(server):
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    with httpx.Client(base_url=server.url, timeout=60) as client, \
            client.stream("GET", "/dashboard/api/events", params={"key": API_KEY}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = sse_events(stream)
        first = next(events)
        assert first["reset"] is True
        total = first["state"]["stats"]["total_blocks"]
        done = threading.Event()

        def complete():
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True}
            r = server.client().post("/v1/completions", json=body)
            assert r.status_code == 200
            done.prompt_tokens = r.json()["usage"]["prompt_tokens"]
            done.set()

        threading.Thread(target=complete).start()
        rows, maps, deadline = [], [], time.monotonic() + 60
        for event in events:
            rows += [(step["i"], *row) for step in event["steps"] for row in step["r"]]
            if event["state"]["view"] is not None:
                maps.append(event["state"]["view"])
            ours = [r for r in rows if r[1].startswith("cmpl-")]
            if done.is_set() and ours and sum(r[4] for r in ours) >= 6:
                break  # every step of it has come
            assert time.monotonic() < deadline, "the request's steps did not all come"
    assert {r[1] for r in ours} == {ours[0][1]}  # one request (n=1): one sample id
    assert sum(r[2] for r in ours) == done.prompt_tokens  # prefill chunks: the whole prompt
    assert sum(1 for r in ours if r[3]) == 5 and sum(r[4] for r in ours) == 6  # 5 decodes, 6 out
    assert [r[0] for r in ours] == sorted(r[0] for r in ours)
    assert all(len(v["states"]) == total for v in maps)
    assert any(set(v["states"]) - {"."} for v in maps)  # its blocks showed up in use or cached


def test_prediction_plans_the_served_model_at_the_live_batch(server, monkeypatch):
    seen = []
    fake = types.ModuleType("memwall.planner")
    fake.plan_json = lambda request: seen.append(request) or {
        "device": "this machine", "notes": [],
        "decode": {"tokens_per_s": 321.5, "bound": "memory"}}
    monkeypatch.setitem(sys.modules, "memwall.planner", fake)
    r = httpx.get(f"{server.url}/dashboard/api/prediction",
                  params={"key": API_KEY, "batch": 6, "context": 700}, timeout=10)
    assert r.status_code == 200
    assert r.json() == {"batch": 6, "context": 700, "tokens_per_s": 321.5, "bound": "memory",
                        "device": "this machine", "notes": []}
    assert seen == [{"device": "this", "batch": 6, "max_model_len": 700}]
    bad = httpx.get(f"{server.url}/dashboard/api/prediction",
                    params={"key": API_KEY, "batch": 0}, timeout=10)
    assert bad.status_code == 400 and "positive" in bad.json()["error"]["message"]


def test_prediction_without_a_calibration_says_how_to_make_one(tmp_path):
    """The real planner, on the embedded model: memory only until this machine is calibrated."""
    import asyncio

    from memwall.entrypoints.openai.dashboard.plan import run_prediction
    served = {"device": "this", "calibration": str(tmp_path / "absent.json")}
    answer = asyncio.run(run_prediction(served, 4, 256))
    assert answer["tokens_per_s"] is None and answer["batch"] == 4
    assert any("--calibrate" in note for note in answer["notes"])


def test_plan_answers_what_the_planner_returns(server, monkeypatch):
    seen = []
    fake = types.ModuleType("memwall.planner")
    fake.plan_json = lambda request: seen.append(request) or {"fits": True, "tokens_per_s": 12.5,
                                                              "memory": {"kv_gib": 1.5}}
    monkeypatch.setitem(sys.modules, "memwall.planner", fake)
    params = {"key": API_KEY}
    r = httpx.post(f"{server.url}/dashboard/api/plan", params=params, json={"model": "m", "batch": 4},
                   timeout=10)
    assert r.status_code == 200 and r.json()["memory"] == {"kv_gib": 1.5}
    assert seen == [{"model": "m", "batch": 4}]
    bad = httpx.post(f"{server.url}/dashboard/api/plan", params=params, content=b"[1, 2]",
                     headers={"content-type": "application/json"}, timeout=10)
    assert bad.status_code == 400 and "JSON object" in bad.json()["error"]["message"]
    broken = httpx.post(f"{server.url}/dashboard/api/plan", params=params, content=b"{nope",
                        headers={"content-type": "application/json"}, timeout=10)
    assert broken.status_code == 400


def test_an_open_stream_does_not_hold_the_shutdown(model_dir, start_server):
    live = start_server(model_dir, api_key=API_KEY)
    opened = threading.Event()

    def watch():
        try:
            with httpx.stream("GET", f"{live.url}/dashboard/api/events", params={"key": API_KEY},
                              timeout=30) as r:
                for _ in sse_events(r):
                    opened.set()
        except httpx.HTTPError:
            pass

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    assert opened.wait(20)
    started = time.monotonic()
    live.stop()
    assert not live.thread.is_alive() and time.monotonic() - started < 10
    reader.join(5)
    assert not reader.is_alive()  # the stream ended with the server


def test_throughput_over_the_window():
    # one step a second for 20 s, 4 tokens each; now = 20.0
    steps = [StepRecord(i, float(i), 0.5, ("a", "b"), (0, 0), (1, 1), (2, 2), (0, 0), (0, 0))
             for i in range(20)]
    tp = throughput(steps, now=20.0, window_s=5.0)  # steps 15..19 ended in [15, 20]
    assert tp["generated_tok_s"] == pytest.approx(20 / 5) and tp["steps"] == 5
    assert tp["step_ms_mean"] == pytest.approx(500) and tp["busy_share"] == pytest.approx(0.5)
    young = throughput(steps[:2], now=2.0, window_s=5.0)  # an engine 2 s old: over those 2 s
    assert young["window_s"] == pytest.approx(2.0) and young["generated_tok_s"] == pytest.approx(4)
    idle = throughput(steps, now=60.0, window_s=5.0)
    assert idle["generated_tok_s"] == 0 and idle["steps"] == 0
