"""The plugin's own settings. SGLang's ServerArgs has no room for plugin flags, so D3D reads the
few it needs from SGLANG_D3D_* environment variables (one typed place, like SGLang's `envs`);
everything SGLang already has a flag for (draft model path, block size) comes from ServerArgs.

    SGLANG_D3D_MODE            auto (default: per batch size, draft + verify or plain decoding,
                               whichever measures faster) | sync (always draft + verify) |
                               async (pre-draft branches while the target verifies: a drafter
                               with its own cache; a full-depth drafter that shares the target
                               runs auto) | fused (every cycle verifies and drafts the next
                               block in one forward of SGLang's target: a full-depth drafter
                               that shares the target, torch_native attention)
    SGLANG_D3D_DRAFT_DEVICE    "" (default: the target's device, own CUDA stream) | cuda:1 | cpu
    SGLANG_D3D_BRANCH_POLICY   topk (default) | all
    SGLANG_D3D_BRANCH_BUDGET   branches pre-drafted under topk, and a fused forward's branches
                               per request (default 4; at least the block: every outcome hits)
    SGLANG_D3D_GUESSES         correction-token guesses per rejection position (default 1)
    SGLANG_D3D_DRAFT_DTYPE     "" (default: the target's dtype) | float32 | bfloat16 | float16
    SGLANG_D3D_COPY_NGRAM      a cycle verifies blocks copied from each request's own text,
                               with no drafter pass, where every request is greedy and its
                               latest N or more tokens occurred before (default 2; 0: never)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from sglang_d3d.config import BranchPolicy, Mode, SpecConfig

ENV_PREFIX = "SGLANG_D3D_"


@dataclass(frozen=True)
class PluginOptions:
    mode: Mode = Mode.SYNC
    plan_per_load: bool = True  # MODE=auto: speculate or decode plainly, per batch size
    draft_device: str = ""  # "" = the target's device
    branch_policy: BranchPolicy = BranchPolicy.TOPK
    branch_budget: int = 4
    guesses_per_position: int = 1
    draft_dtype: str = ""  # "" = the target's dtype
    copy_ngram: int = 2  # EngineConfig.copy_ngram; 0: never
    corpus_tokens: int = 1 << 21  # EngineConfig.corpus_tokens; 0: no copies from the corpus

    def __post_init__(self) -> None:
        if self.mode is Mode.AR:
            raise ValueError(
                f"{ENV_PREFIX}MODE=ar makes no sense for a speculative algorithm; "
                "drop --speculative-algorithm instead"
            )
        if self.copy_ngram < 0:
            raise ValueError(f"{ENV_PREFIX}COPY_NGRAM must be >= 0, not {self.copy_ngram}")
        if self.corpus_tokens < 0:
            raise ValueError(f"{ENV_PREFIX}CORPUS_TOKENS must be >= 0, not {self.corpus_tokens}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginOptions:
        env = os.environ if env is None else env

        def get(name: str, default: str) -> str:
            return env.get(ENV_PREFIX + name, default).strip()

        mode = get("MODE", "auto").lower()
        try:
            return cls(
                mode=Mode.SYNC if mode == "auto" else Mode(mode),
                plan_per_load=mode == "auto",
                draft_device=get("DRAFT_DEVICE", ""),
                branch_policy=BranchPolicy(get("BRANCH_POLICY", "topk").lower()),
                branch_budget=int(get("BRANCH_BUDGET", "4")),
                guesses_per_position=int(get("GUESSES", "1")),
                draft_dtype=get("DRAFT_DTYPE", ""),
                copy_ngram=int(get("COPY_NGRAM", "2")),
                corpus_tokens=int(get("CORPUS_TOKENS", str(1 << 21))),
            )
        except ValueError as e:
            raise ValueError(f"bad {ENV_PREFIX}* setting: {e}") from e

    def spec_config(self, block_size: int) -> SpecConfig:
        return SpecConfig(
            block_size=block_size,
            branch_policy=self.branch_policy,
            branch_budget=self.branch_budget,
            guesses_per_position=self.guesses_per_position,
        )
