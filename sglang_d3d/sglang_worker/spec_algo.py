"""How the D3D algorithm presents itself to SGLang's scheduler.

SGLang dispatches on `is_*()` / `supports_*()` predicates of the algorithm object. D3D keeps the
plugin defaults (it is none of the builtins) and adds what 0.5.23's `CustomSpecAlgo` lacks but
the scheduler calls on every algorithm: `create_future_map`, `need_topk` and
`carries_draft_hidden_states` (without them a plugin algorithm fails with AttributeError when
the scheduler starts; tests/test_sglang_plugin.py checks the list against SGLang's enum).

CUDA graphs off, for real. SGLang 0.5.23 turns its flags into `cuda_graph_config`
(a backend per phase) in `handle_cuda_graph_config`, long before the speculative hook that
calls `handle_server_args`: setting the legacy `disable_cuda_graph` here changes nothing. Left
on, the decode graph runner captures TARGET_VERIFY graphs with no verify input for a plugin
algorithm (flashinfer asserts `prefix_lens is not None`), and the prefill (breakable) graph
runner also takes TARGET_VERIFY batches (`ForwardMode.is_extend` includes them). So D3D
declares the resolved config itself, every phase disabled; the worker's verify runs eagerly.
"""

from __future__ import annotations

import logging

from sglang.srt.model_executor.cuda_graph_config import (
    Backend,
    CudaGraphConfig,
    Phase,
    default_cuda_graph_config,
    with_phase,
)
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sglang_d3d.sglang_worker.validation import resolve_server_args

log = logging.getLogger(__name__)


class D3DSpecAlgo(CustomSpecAlgo):
    def handle_server_args(self, server_args) -> None:
        resolve_server_args(server_args)
        if not _graphs_disabled(server_args.cuda_graph_config):
            log.warning("D3D runs its verify pass without CUDA graphs (every phase disabled)")
        server_args.cuda_graph_config = cuda_graphs_disabled(server_args.cuda_graph_config)
        server_args.disable_cuda_graph = True  # the legacy flag some SGLang paths still read

    def need_topk(self) -> bool:
        return False  # a chain: one candidate per position

    def carries_draft_hidden_states(self) -> bool:
        return False  # the drafter never reads target hidden states

    def has_draft_kv(self) -> bool:
        return False  # the drafter's KV lives in its own cache, not in SGLang's pool

    def create_future_map(
        self,
        device,
        req_to_token_pool,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(
            device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay
        )


def cuda_graphs_disabled(config: CudaGraphConfig | None) -> CudaGraphConfig:
    """A copy of `config` with every phase's capture backend disabled (other settings kept)."""
    config = config if config is not None else default_cuda_graph_config()
    for phase in Phase.ALL:
        config = with_phase(config, phase, backend=Backend.DISABLED)
    return config


def _graphs_disabled(config: CudaGraphConfig | None) -> bool:
    return config is not None and all(
        getattr(config, phase).backend == Backend.DISABLED for phase in Phase.ALL
    )
