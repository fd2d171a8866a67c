"""Prefix-cache and preemption metrics on /metrics, and the priority extension."""

from __future__ import annotations


def test_repeated_prefix_is_served_from_cache_and_counted(server):
    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    hits_before = server.metric("memwall:prefix_cache_hits_total")
    queries_before = server.metric("memwall:prefix_cache_queries_total")
    with server.client() as client:
        for question in ("Why?", "How?"):
            r = client.post("/v1/completions", json={"prompt": prompt + question, "max_tokens": 4,
                                                     "temperature": 0, "priority": 3})
            assert r.status_code == 200, r.text
    server.wait_idle()
    hits = server.metric("memwall:prefix_cache_hits_total") - hits_before
    queries = server.metric("memwall:prefix_cache_queries_total") - queries_before
    assert queries > 0 and hits >= 0.5 * queries / 2  # the second request reuses the shared part
    assert 0.0 < server.metric("memwall:prefix_cache_hit_rate") <= 1.0
    text = __import__("httpx").get(f"{server.url}/metrics").text
    assert 'memwall:preemptions_by_mode_total{mode="swap"}' in text
    assert "memwall:prefix_cache_evictions_total" in text


def test_priority_must_be_an_integer(server):
    with server.client() as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "priority": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
