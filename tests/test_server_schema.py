"""Schemathesis fuzzes every endpoint from the server's own OpenAPI schema: no 5xx, ever.

Valid and invalid bodies both reach the real engine path (tiny pair); the example count is
bounded so the whole run stays well under a minute on two cores.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from sglang_d3d.server.app import create_app
from sglang_d3d.server.testing import ServerThread, tiny_server_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv(tiny_pair_dir):
    # A small context keeps generated requests (up to max_tokens = the context) short.
    cfg = tiny_server_config(tiny_pair_dir, max_context=64)
    with ServerThread(create_app(cfg)) as s:
        yield s


# schemathesis' own pytest plugin (from_fixture) does not run under pytest 9, so the cases are
# drawn with Hypothesis directly from the schema's strategy over all operations.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(srv, mode):
    api = schemathesis.openapi.from_url(f"{srv.url}/openapi.json")
    seen: set[str] = set()

    @given(case=api.as_strategy(mode))
    @settings(
        max_examples=100,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,  # the same cases every run: a failure here is never a fluke
    )
    def run(case):
        seen.add(case.operation.label)
        case.call_and_validate(checks=[not_a_server_error])

    run()
    assert {"POST /v1/chat/completions", "POST /v1/completions"} <= seen


def test_still_healthy_after_fuzzing(srv):
    assert httpx.get(f"{srv.url}/health").status_code == 200
