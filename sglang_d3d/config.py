"""Frozen configuration dataclasses. Each layer of the stack takes the config of the layer below.

SpecConfig -> EngineConfig -> ServerConfig (server/). Derived values are properties.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace


class Mode(str, enum.Enum):
    """Decoding mode; all of them run in one engine so they can be measured side by side."""

    AR = "ar"  # target only
    SYNC = "sync"  # draft, then verify, then draft (the DFlash-style sequential loop)
    ASYNC = "async"  # D3D: pre-draft branches for round k+1 while the target verifies round k
    # The drafter's next blocks ride in the target's verify pass, anchored at the drafts under
    # verification (speculative/fused.py): a full-depth drafter on the target's device only.
    FUSED = "fused"


class BranchPolicy(str, enum.Enum):
    """Which verification outcomes the drafter pre-drafts for while the target verifies."""

    ALL = "all"  # every rejection position plus full acceptance (num_drafts + 1 outcomes)
    TOPK = "topk"  # only the `branch_budget` most likely outcomes by the drafter's own confidence


DRAFT_WEIGHTS = ("auto", "full", "int8")
DRAFT_INPUT_BITS = (8, 14)
TARGET_WEIGHTS = ("auto", "fp32", "q4")
GREEDY_BELOW = 1e-5  # temperatures under this are greedy
MAX_PENALTY = 2.0  # OpenAI's range for frequency and presence penalties: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # and for a logit_bias value: [-100, 100]
MAX_REPETITION_PENALTY = 2.0  # vLLM's and SGLang's extension: (0, 2] here, 1 = none
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


@dataclass(frozen=True)
class GrammarSpec:
    """Structured output: the answer must match `source`, a JSON schema (as JSON text), a
    regular expression or an EBNF grammar (speculative/grammar.py compiles it)."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError("a grammar needs a non-empty source")


# OpenAI's `response_format: {"type": "json_object"}`: any JSON object (SGLang's choice too).
JSON_OBJECT = GrammarSpec("json_schema", '{"type": "object"}')


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    min_p: float = 0.0  # drop tokens below min_p times the likeliest one's probability (0: off)
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # vLLM's: the model's end-of-sequence tokens do not end it
    min_tokens: int = 0  # vLLM's: no stop token (EOS or stop_token_ids) before this many tokens
    # Logit rules on what the request has written (speculative/penalties.py)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids unique
    repetition_penalty: float = 1.0  # vLLM's: divides (> 0) or multiplies a seen token's logit
    grammar: GrammarSpec | None = None  # structured output: only tokens the grammar allows

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError("min_tokens must be in [0, max_new_tokens]")
        self._check_rules()
        self._check_grammar()

    def _check_grammar(self) -> None:
        # A grammar decides where the answer ends (its end allows only end-of-sequence), so
        # neither can be overruled: running past EOS, or a minimum length banning EOS.
        if self.grammar is not None and (self.ignore_eos or self.min_tokens):
            raise ValueError("a grammar (structured output) cannot be combined with ignore_eos "
                             "or min_tokens: the grammar decides where the answer ends")

    def _check_rules(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if not abs(getattr(self, name)) <= MAX_PENALTY:  # NaN fails too
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        ids = [t for t, _ in self.logit_bias]
        if any(t < 0 for t in ids) or len(set(ids)) != len(ids):
            raise ValueError("logit_bias token ids must be unique and >= 0")
        if not all(abs(b) <= MAX_LOGIT_BIAS for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]")

    @property
    def reshapes_logits(self) -> bool:
        """Whether the target's logits change with what the request has written (penalties, a
        minimum length) or carry a bias: verification must then reshape them row by row
        (speculative/penalties.py)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens)

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32; the limit of sampling is argmax.
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class SpecConfig:
    """Speculation shape.

    block_size: tokens the target verifies per cycle = the last accepted token + (block_size - 1)
    drafts. The drafter fills block_size mask slots: block_size - 1 drafts and, in the last slot,
    its guess of the bonus token (used for the full-acceptance branch).
    """

    block_size: int = 16
    branch_policy: BranchPolicy = BranchPolicy.TOPK
    branch_budget: int = 4  # number of branches pre-drafted under TOPK (fused: per verify)
    guesses_per_position: int = 1  # correction-token guesses per rejection position

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2")
        if self.branch_budget < 1:
            raise ValueError("branch_budget must be >= 1")
        if self.guesses_per_position < 1:
            raise ValueError("guesses_per_position must be >= 1")

    @property
    def num_drafts(self) -> int:
        return self.block_size - 1

    @property
    def num_outcomes(self) -> int:
        return self.num_drafts + 1


@dataclass(frozen=True)
class EngineConfig:
    mode: Mode = Mode.ASYNC
    spec: SpecConfig = field(default_factory=SpecConfig)
    target_path: str | None = None  # None: the default SmolLM2-135M-Instruct
    drafter_path: str | None = None  # None: the shipped default drafter
    device: str = "cpu"
    draft_device: str | None = None  # None: same as device
    dtype: str = "auto"  # auto: bf16 on GPUs, fp32 on CPUs (engine/factory.py engine_dtype)
    max_batch_size: int = 16  # running requests per cycle (slots in the KV caches)
    max_context: int = 2048  # per-request KV capacity (prompt + generated)
    max_queue: int = 256  # waiting requests beyond this are refused (HTTP 503)
    # Adaptive speculation: the verify pass holds at most this many tokens in total, so the
    # block shrinks as the batch grows; below min_block_size the engine decodes target-only.
    verify_token_budget: int = 64
    min_block_size: int = 3
    # sync/async/fused without `adaptive`: a cycle's block at batch 1, at most spec.block_size
    # and within the verify token budget. None: by what a token of verify width costs the target
    # (`verify_widths`): spec.block_size where a verify pass's rows share it, 4 where they run
    # apart (the q4 target, where a block of 16 drafts and verifies 16 rows a cycle: `sync` ran
    # at 0.67x / 0.39x of `ar` on GSM8K / MT-Bench at block 16 with trees of 3, 1.01x / 0.70x at
    # block 4 with chains; benchmarks/results/trees_xeon106_*.json). `--block-size` sets both.
    fixed_block: int | None = None
    # adaptive=True replaces the budget rule by measurement: per batch size, the block size
    # (or target-only decoding) with the best measured tokens/s (engine/adaptive.py).
    adaptive: bool = False
    # With adaptive: time every plan at every batch bucket on synthetic requests before serving
    # (engine/calibrate.py), so no real request pays for the controller's warm-up cycles.
    calibrate: bool = False
    # Chunked prefill: while other requests decode, a step prefills at most prefill_chunk
    # prompt tokens (one packed pass, then their decode cycle), so a long prompt no longer
    # stalls every stream; with nobody decoding, a pass takes up to max_prefill_tokens.
    prefill_chunk: int = 64
    max_prefill_tokens: int = 1024
    draft_threads: int = 1  # intra-op threads of the drafter's worker (CPU)
    # The drafter's projection weights on CPU: "int8" (models/int8_linear.py; a quarter of the
    # bytes a pass reads), "full" (the target's own, plus the deltas: 4-bit where the target
    # runs on q4), or "auto": int8 where the drafter runs on a CPU in fp32 with fbgemm (with
    # a q4 target too: a block-16 draft pass measured 212 ms int8 against 397 on the 4-bit
    # base, whose kernel slows per row past a few rows; benchmarks/bench_passes.py).
    draft_weights: str = "auto"
    # On a 4-bit target's C++ loop, the drafter's passes round each projection's inputs to this
    # many bits of their block's range: 14 as the target's own passes, or 8, one byte dot
    # product a weight byte instead of two (models/csrc/block_mm.cpp). Drafts only propose and
    # the target verifies each, so the output is the same either way; 8 made the projections
    # 6-18% faster at 1 to 16 rows on AVX-512 VNNI, with acceptance unchanged
    # (`benchmarks/bench_rows.py`, docs/benchmarks.md).
    draft_input_bits: int = 8
    # The target's projection weights in its inference passes: "q4" (the Q4_1 blocks of the
    # GGUF it was converted from, models/q4_target.py: a sixth of fp32's bytes a step),
    # "fp32" (the weights as loaded, equal to HF generate), or "auto": q4 where the target
    # came from a Q4_1 GGUF (the default target) and runs on a CPU in fp32, else fp32. auto
    # is the default because q4 is the faster path end to end there: the server's
    # configuration on it beat the same on fp32 on GSM8K, MT-Bench and code in one process
    # (`benchmarks/bench_peers.py --peers d3d,d3d-fp32`, docs/benchmarks.md).
    target_weights: str = "auto"
    target_threads: int = 1  # intra-op threads of the target's worker (CPU)
    # sync/async: a row verifies its leading drafts while the product of the drafter's
    # probabilities of them stays >= draft_cutoff (speculative/draft_length.py); 0 verifies
    # every block whole. Exact either way: it only decides how many drafts are put to the test.
    # Off by default: on this CPU 0.05 made a fixed block of 8 faster (sync@8 on GSM8K 1.46x of
    # ar against 1.35x whole) but not the adaptive controller, which already verifies blocks
    # of 4, and a verify pass of up to about 4 tokens costs what one token's does, so cutting
    # below that loses tokens and saves nothing (`d3d bench`, the step-600 drafter).
    draft_cutoff: float = 0.0
    # sync/async, cycles without pre-drafting: verify a tree of this many draft tokens
    # (greedy rows: the drafter's likeliest paths, several guesses per position; sampled rows:
    # the same shape filled with draws) instead of a chain of block_size - 1
    # (speculative/tree.py, tree_sampling.py); 0: chains. Exact either way. None: by what a
    # token of verify width costs the target (`verify_widths`).
    tree_nodes: int | None = None
    # ... and up to this many more guesses copied from the request's own text after its first
    # draft (prompt lookup, speculative/lookup.py), where a 2-4 token suffix occurred before;
    # 0: none. Exact either way: the target verifies them in the same tree (a sampled row's
    # as proposed with probability one, speculative/tree_sampling.py). None: by what a token
    # of verify width costs the target (`verify_widths`).
    lookup_tokens: int | None = None
    # A row whose latest `copy_ngram` or more tokens occurred before verifies a copy of what
    # followed in place of drafting (0: never; copies then only ride in the drafter's trees).
    # Where every row copies, the cycle makes no drafter pass. A greedy row beside rows that
    # draft takes its copy in its tree instead; a sampled row verifies its copy alone either
    # way, as a chain of sure nodes among the batch's trees, so that its draws do not depend
    # on its batch (it copies only where a cycle verifies trees: trees on, no pre-drafting).
    # A copy after a 2-token match was right for about as many tokens a cycle as the
    # drafter's tree, in the time of a verify pass.
    copy_ngram: int = 2
    # A greedy row whose own text has no copy looks in the last this many tokens of finished
    # requests' texts (prompts and answers) for what followed its last 3 tokens
    # (speculative/shared_lookup.py); 0: off. Sampled rows never do (their draws must not
    # depend on other requests). Exact either way; a server whose tenants must not time
    # guesses from each other's text turns it off.
    shared_lookup_tokens: int = 1 << 16
    # A greedy row with no copy in its own text (nor, with shared_lookup_tokens, in earlier
    # requests') copies what the target most often said after its last 3-6 tokens in the
    # drafter's corpus, the target's own answers it was distilled on (models/corpus.py,
    # speculative/corpus_lookup.py): at most this many tokens of it are indexed; 0: off. A
    # drafter folder without corpus.npz has none. Exact either way.
    corpus_tokens: int = 1 << 21
    # A cycle of copies verifies a greedy row's copy as one token tree with the other texts'
    # guesses beside it: earlier requests' continuation and the corpus's likeliest
    # (corpus_lookup.py `guesses`), at most this many guessed tokens a pass beyond the rows'
    # copies, shared out among its rows (a row's share is copy_guesses // batch, within the
    # verify token budget); 0: copies alone, as chains. Whether a cycle does, or verifies
    # copies cut to half their length alone (or, at batch 1, whole copies alone), each batch
    # bucket measures and keeps the fastest,
    # or the controller's plan where it expects more of that (engine/copy_arms.py): a token of
    # verify width costs more on some machines than the guesses bring. Exact either way.
    # None: by what a token of verify width costs the target (`verify_widths`).
    copy_guesses: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.draft_cutoff < 1:
            raise ValueError(f"draft_cutoff must be in [0, 1), not {self.draft_cutoff}")
        counts = {"tree_nodes": self.tree_nodes, "lookup_tokens": self.lookup_tokens,
                  "copy_ngram": self.copy_ngram, "shared_lookup_tokens": self.shared_lookup_tokens,
                  "corpus_tokens": self.corpus_tokens, "copy_guesses": self.copy_guesses}
        counts = {k: v for k, v in counts.items() if v is not None}  # None: set by the target
        if min(counts.values()) < 0:
            raise ValueError("must be >= 0: " + ", ".join(f"{k} {v}" for k, v in counts.items() if v < 0))
        if self.fixed_block is not None and self.fixed_block < 2:
            raise ValueError(f"fixed_block must be >= 2, not {self.fixed_block}")
        if self.max_batch_size < 1 or self.max_context < 8:
            raise ValueError("max_batch_size >= 1 and max_context >= 8 required")
        if self.prefill_chunk < 1 or self.max_prefill_tokens < self.prefill_chunk:
            raise ValueError("1 <= prefill_chunk <= max_prefill_tokens required")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights must be one of {DRAFT_WEIGHTS}, "
                             f"not {self.draft_weights!r}")
        if self.draft_input_bits not in DRAFT_INPUT_BITS:
            raise ValueError(f"draft_input_bits must be one of {DRAFT_INPUT_BITS}, "
                             f"not {self.draft_input_bits!r}")
        if self.target_weights not in TARGET_WEIGHTS:
            raise ValueError(f"target_weights must be one of {TARGET_WEIGHTS}, "
                             f"not {self.target_weights!r}")
        if self.mode is Mode.FUSED and self.draft_weights == "int8":
            raise ValueError("fused mode computes the target in the drafter's pass, so its "
                             "weights stay full precision: use draft_weights 'auto' or 'full'")

    @property
    def resolved_draft_device(self) -> str:
        return self.draft_device or self.device

    def with_verify_widths(self, rows_apart: bool) -> EngineConfig:
        """This config with lookup_tokens, copy_guesses, tree_nodes and fixed_block set where
        they are None, for a target whose verify passes keep every row's attention apart
        (`rows_apart`) or not."""
        lookup, guesses, trees = verify_widths(self.lookup_tokens, self.copy_guesses,
                                               self.tree_nodes, rows_apart)
        block = self.fixed_block or (APART_ROW_BLOCK if rows_apart else self.spec.block_size)
        return replace(self, lookup_tokens=lookup, copy_guesses=guesses, tree_nodes=trees,
                       fixed_block=min(block, self.spec.block_size))


# (lookup_tokens, copy_guesses, tree_nodes) where a config leaves them None. A verify pass
# whose rows share one attention call per layer costs little a token of width (fp32 on a
# 2-core CPU: a 16-token verify about 1.7 plain steps), so copies run long with guesses beside
# them, and trees of 5 drafts (a verify pass of 6 tokens, which there costs about what one of
# 4 does) were faster than chains on GSM8K, MT-Bench and code at batch 1 (`d3d bench`, the
# step-600 drafter). Where every row's attention runs alone, for bitwise-equal rows (the q4
# target), a token of width costs about a quarter of a plain step (4 rows 1.8 plain steps, 16
# rows 7; benchmarks/results/passes.json), and short copies alone win: on the default target
# in q4, the server's configuration ran GSM8K, MT-Bench and code at 60.8, 47.9 and 59.0
# tokens/s with (4, 0) against 45.8, 42.3 and 48.1 with (8, 8) (`d3d bench --target-weights q4
# --modes ar,async-adaptive@8,async-adaptive-lookup4-guesses0@8`, 4 prompts, 128 tokens, 2
# threads, before the layers ran in one C++ call); on fp32, (8, 8) stayed ahead on GSM8K (37.8
# against 36.5). With the C++ layers, 2- and 3-token copies led on no set, and at a block of 4
# chains beat trees: `sync@4` ran at 1.01x / 0.70x of `ar` on GSM8K / MT-Bench with chains,
# 0.91x / 0.67x with trees of 3 and 0.88x / 0.60x with trees of 5 (a drafting cycle 2.95 tokens
# in 33.5 ms against 3.39 in 50.3 on GSM8K; benchmarks/results/trees_xeon106_*.json,
# docs/benchmarks.md).
SHARED_ROW_WIDTHS = (8, 8, 5)
APART_ROW_WIDTHS = (4, 0, 0)
APART_ROW_BLOCK = 4  # EngineConfig.fixed_block where rows run apart


def verify_widths(lookup: int | None, guesses: int | None, trees: int | None,
                  rows_apart: bool) -> tuple[int, int, int]:
    """(lookup_tokens, copy_guesses, tree_nodes): each as given, or where None the default for
    a target whose verify rows run apart or share their passes."""
    d_lookup, d_guesses, d_trees = APART_ROW_WIDTHS if rows_apart else SHARED_ROW_WIDTHS
    return (d_lookup if lookup is None else lookup, d_guesses if guesses is None else guesses,
            d_trees if trees is None else trees)
