"""Property-based fuzz of the served OpenAPI schema (schemathesis): no input may produce a 5xx.

Bounded: a fixed number of examples per operation, valid (positive) and schema-violating
(negative) bodies, and generation-heavy fields clamped so that a generated `max_tokens=10**6` or
`n=128` costs milliseconds rather than minutes on CPU (the limits themselves are tested in
test_server_errors.py).
"""
from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from server_util import MAIN_ARGS, shared_server

pytestmark = pytest.mark.slow
EXAMPLES_PER_OPERATION = 10
BUDGET_S = 60.0


@pytest.fixture(scope="session")
def server(request):
    return shared_server(request, *MAIN_ARGS)


def clamp(body):
    """Keep generated requests cheap to serve without changing what is being validated."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and not isinstance(body.get(field), bool) and body[field] > 2:
            body[field] = 2
    if "max_tokens" not in body and "messages" in body:
        body["max_tokens"] = 2  # chat defaults to the whole remaining context
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("min_tokens"), int) and not isinstance(body.get("min_tokens"), bool):
        body["min_tokens"] = min(body["min_tokens"], 2)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        body["prompt"] = prompt[:200]
    elif isinstance(prompt, list):
        body["prompt"] = [p[:50] if isinstance(p, (str, list)) else p for p in prompt[:3]]
    return body


def unpin_all(url: str) -> None:
    """The fuzzer pins prefixes (POST /v1/cache/pins is open without API keys): unpin them, or
    the shared server's pool keeps them held for the tests that come after."""
    pins = httpx.get(f"{url}/v1/cache/pins", timeout=30).json()["data"]
    for pin in pins:
        assert httpx.delete(f"{url}/v1/cache/pins/{pin['id']}", timeout=30).status_code == 200
    assert httpx.get(f"{url}/v1/cache/pins", timeout=30).json()["data"] == []


def test_openapi_schema_is_served(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"):
        assert path in spec["paths"]


def test_fuzz_finds_no_server_errors(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    start = time.monotonic()
    runs = [(op, mode) for op in operations for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    covered = set()
    failures: list[str] = []
    statuses: dict[int, int] = {}
    session = httpx.Client(timeout=60)

    for k, (op, mode) in enumerate(runs):
        # Each (operation, mode) gets an equal slice of the budget; time a cheap one leaves rolls over.
        deadline = start + BUDGET_S * (k + 1) / len(runs)
        sent = [0]  # every (operation, mode) sends at least one case, however slow the machine

        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(mode))
        def run(case):
            if sent[0] and time.monotonic() > deadline:
                return
            kwargs = case.as_transport_kwargs(base_url=server.url)
            if "json" in kwargs:
                kwargs["json"] = clamp(kwargs["json"])
            try:
                response = session.request(kwargs.pop("method"), kwargs.pop("url"),
                                           **{k: v for k, v in kwargs.items()
                                              if k in ("json", "content", "headers", "params")})
            except httpx.LocalProtocolError:  # e.g. a header value HTTP cannot carry: never sent
                return
            sent[0] += 1
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            covered.add(f"{case.method} {case.path}")
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {kwargs.get('json')!r} -> "
                                f"{response.status_code} {response.text[:300]}")

        try:
            run()
        except Unsatisfiable:  # nothing schema-violating to generate (e.g. GET /health has no inputs)
            pass
    unpin_all(server.url)
    print("statuses:", dict(sorted(statuses.items())), "operations:", sorted(covered))
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize"} <= covered
    assert not failures, "\n".join(failures[:10])
    assert statuses.get(200, 0) > 5 and sum(v for k, v in statuses.items() if 400 <= k < 500) > 5, statuses
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "Traceback" not in server.log()
