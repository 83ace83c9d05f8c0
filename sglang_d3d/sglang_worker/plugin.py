"""SGLang plugin entry point (`sglang.srt.plugins` group, see pyproject.toml).

SGLang calls `register()` in every process it starts (server, scheduler, detokenizer) before it
parses server arguments, so `--speculative-algorithm D3D` resolves to `D3DSpecAlgo` and the
scheduler builds `D3DWorker` through `create_worker`.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

ALGORITHM_NAME = "D3D"


def register() -> None:
    """Register D3D with SGLang's speculative-algorithm registry. Idempotent."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from sglang_d3d.sglang_worker.spec_algo import D3DSpecAlgo
    from sglang_d3d.sglang_worker.validation import validate_server_args

    if get_spec(ALGORITHM_NAME) is not None:
        return
    SpeculativeAlgorithm.register(
        ALGORITHM_NAME,
        # The worker drives SGLang's scheduler synchronously (no overlap schedule); D3D's own
        # overlap (drafter vs target) happens inside one forward_batch_generation call.
        supports_overlap=False,
        validate_server_args=validate_server_args,
        spec_class=D3DSpecAlgo,
    )(_worker_class)
    log.info("registered speculative algorithm %s", ALGORITHM_NAME)


def _worker_class(server_args):
    from sglang_d3d.sglang_worker.worker import D3DWorker

    return D3DWorker
