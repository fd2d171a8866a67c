"""The OpenAI-compatible HTTP server (FastAPI). The only package in memwall that imports FastAPI.

Reading order: server.py (routes, auth, lifespan) -> serving_completions.py / serving_chat.py
(request -> SamplingParams -> engine stream -> response) -> protocol.py (the wire format) ->
errors.py -> metrics.py. The engine side is memwall/engine/async_engine.py.
"""
