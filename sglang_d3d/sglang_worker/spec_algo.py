"""How the D3D algorithm presents itself to SGLang's scheduler.

SGLang dispatches on `is_*()` / `supports_*()` predicates of the algorithm object. D3D keeps the
plugin defaults (it is none of the builtins) and adds what 0.5.23's `CustomSpecAlgo` lacks but
the scheduler calls on every algorithm: `create_future_map`, `need_topk` and
`carries_draft_hidden_states` (without them a plugin algorithm fails with AttributeError when
the scheduler starts; tests/test_sglang_plugin.py checks the list against SGLang's enum).
"""

from __future__ import annotations

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sglang_d3d.sglang_worker.validation import resolve_server_args


class D3DSpecAlgo(CustomSpecAlgo):
    def handle_server_args(self, server_args) -> None:
        resolve_server_args(server_args)

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
