"""SGLang plugin entry point (`sglang.srt.plugins` group, see pyproject.toml).

SGLang calls `register()` in every process it starts (server, scheduler, detokenizer) before it
parses server arguments, so `--speculative-algorithm D3D` resolves to `D3DSpecAlgo` and the
scheduler builds `D3DWorker` through `create_worker`.
"""

from __future__ import annotations

import logging
import sys
import traceback

log = logging.getLogger(__name__)

ALGORITHM_NAME = "D3D"


def register() -> None:
    """Register D3D with SGLang's speculative-algorithm registry. Idempotent.

    SGLang's plugin loader catches what a plugin raises and logs it before its logging is set
    up, so a failure here would surface only later, as "Unknown speculative algorithm name:
    D3D". The cause goes to stderr (and this module's log) before it propagates."""
    try:
        _register()
    except Exception as e:
        cause = "".join(traceback.format_exception(e))
        message = f"sglang-d3d: registering --speculative-algorithm {ALGORITHM_NAME} failed:"
        print(f"{message}\n{cause}", file=sys.stderr, flush=True)
        log.error("%s %r", message, e)
        raise


def _register() -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from sglang_d3d.sglang_worker.spec_algo import D3DSpecAlgo
    from sglang_d3d.sglang_worker.validation import validate_server_args

    if get_spec(ALGORITHM_NAME) is not None:
        return
    SpeculativeAlgorithm.register(
        ALGORITHM_NAME,
        # In SGLang 0.5.23 this flag only gates `create_worker`: False is deprecated (a warning
        # at every start, and a refusal where overlap scheduling is on). D3D turns SGLang's
        # overlap schedule off itself (validation.resolve_server_args), so the worker still runs
        # synchronously; D3D's own overlap (drafter vs target) is inside one
        # forward_batch_generation call.
        supports_overlap=True,
        validate_server_args=validate_server_args,
        spec_class=D3DSpecAlgo,
    )(_worker_class)
    log.info("registered speculative algorithm %s", ALGORITHM_NAME)


def _worker_class(server_args):
    from sglang_d3d.sglang_worker.worker import D3DWorker

    return D3DWorker
