"""What SGLang carries on a running batch between D3D rounds (`ScheduleBatch.spec_info`).

Nothing tensor-shaped: the next verify block starts with each request's newest token, which
SGLang already records in `req.output_ids`, and the drafts live in the worker's request table.
The scheduler still filters and merges this object with the batch, so it must accept that.
"""

from __future__ import annotations

from sglang.srt.speculative.spec_info import SpecInput, SpecInputType


class D3DDraftInput(SpecInput):
    def __init__(self) -> None:
        # DFLASH_DRAFT: SGLang's tag for "draft-side state of a linear block drafter".
        super().__init__(spec_input_type=SpecInputType.DFLASH_DRAFT)
        self.num_tokens_per_req = 1
        self.num_tokens_for_logprob_per_req = 1
        self.future_indices = None

    def filter_batch(self, new_indices=None, new_indices_cpu=None, **kwargs) -> None:
        pass

    def merge_batch(self, other) -> None:
        pass
