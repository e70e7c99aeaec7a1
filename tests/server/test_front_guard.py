"""The front door's body guard (issue 42): every route that takes a body answers a too-deep, too-wide,
non-UTF-8 or NaN-bearing body with a 400 in its own API family's error shape, before its parser runs;
the routes are walked from the app, so a route added later is covered without a new row here."""

from __future__ import annotations

import httpx
import pytest

DEEP_METADATA = b'{"model":"m","max_tokens":1,"messages":[],"metadata":' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001
DEEP_ARRAY = b"[" * 100_000 + b"]" * 100_000
WIDE_ARRAY = b'{"prompt":[' + b",".join([b"1"] * 600_000) + b"]}"
NOT_UTF8 = b'{"model":"m","prompt":"\xff\xfe"}'
NAN = b'{"model":"m","prompt":"hi","temperature":NaN}'


def body_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route that reads a body, path parameters filled with a dummy id."""
    found = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method in ("POST", "PUT", "PATCH"):
                path = route.path.replace("{cache_id}", "cache-x").replace("{response_id}", "resp_x")
                found.append((method, path))
    return found


def error_message(path: str, body: dict) -> str:
    """The message of each API family's documented error shape (fails on any other shape)."""
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]["message"]
    if path.startswith("/api/"):
        assert isinstance(body["error"], str), body
        return body["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]["message"]


def test_the_app_has_many_body_routes(server):
    routes = body_routes(server.server.config.app)
    assert ("POST", "/v1/messages") in routes and ("POST", "/v1/messages/count_tokens") in routes
    assert len(routes) >= 12, routes


@pytest.mark.parametrize("body,expected", [
    (DEEP_METADATA, "nests"), (DEEP_ARRAY, "nests"), (WIDE_ARRAY, "array items"),
    (NOT_UTF8, "UTF-8"), (NAN, "NaN")], ids=["deep-metadata", "deep-array", "wide-array", "not-utf8", "nan"])
def test_every_body_route_refuses_a_bad_structure_with_a_400(server, body, expected):
    wrong = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for method, path in body_routes(server.server.config.app):
            response = http.request(method, path, content=body,
                                    headers={"content-type": "application/json"})
            if response.status_code != 400 or expected not in error_message(path, response.json()):
                wrong.append((method, path, response.status_code, response.text[:120]))
    assert not wrong, wrong


def test_a_body_inside_the_bounds_still_reaches_the_route(server, model_name):
    nested = {"a": 1}
    for _ in range(40):  # a deep but legitimate structure: the route answers it
        nested = {"a": nested}
    response = httpx.post(server.url + "/v1/messages/count_tokens", timeout=60, json={
        "model": model_name, "messages": [{"role": "user", "content": "hi"}], "metadata": nested})
    assert response.status_code in (200, 400) and "nests" not in response.text, response.text[:300]


def test_body_problem_counts_strings_as_scalars():
    from kvserve.server.body_guard import BodyShape, body_problem

    shape = BodyShape(max_depth=3, max_elements=4)
    assert body_problem(b'{"a": "[[[[[[,,,,,,NaN\\" {{{{"}', shape) is None
    assert "nests 4" in body_problem(b'[[[["x"]]]]', shape).message
    assert "5 array items" in body_problem(b"[1,2,3,4,5]", shape).message
    assert body_problem(b'{"top_p": -Infinity}', shape).param == "top_p"
