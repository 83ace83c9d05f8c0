"""Tiny random model pairs for tests: built in seconds, saved like real checkpoints.

Never downloads anything; the configs are written here.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VOCAB = 96
TINY_EOS = 2  # the tiny configs' end-of-sequence id
# Above uint16's range, as Llama 3 (128k) and Qwen (151k) vocabularies are.
LARGE_VOCAB = 70_000
# Every supported family (models/architectures.py), in the shapes tests build: "llama3" is
# Llama with Llama 3.1's rope scaling, its original context shrunk so that the scaled
# frequencies matter within a tiny model's positions.
TINY_ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
TINY_WINDOW = 256  # the tiny Mistral's sliding window (its context is capped there)


def tiny_config(arch: str = "llama", vocab: int = TINY_VOCAB, layers: int = 4, tied: bool = True):
    """A tiny transformers config of a supported family (TINY_ARCHS)."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=TINY_EOS,
        pad_token_id=0,
        tie_word_embeddings=tied,
    )
    extra = {
        "llama": {},
        "llama3": {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": False},  # as 8B
        "mistral": {"sliding_window": TINY_WINDOW},
        "qwen2": {},  # q/k/v biases are the family's own
        "qwen3": {"head_dim": 16},
    }
    if arch not in extra:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {', '.join(TINY_ARCHS)}")
    model_type = "llama" if arch == "llama3" else arch
    return AutoConfig.for_model(model_type, **{**common, **extra[arch]})


def tiny_hf_model(
    arch: str = "llama", seed: int = 0, vocab: int = TINY_VOCAB, layers: int = 4, tied: bool = True
):
    """A random causal LM of a supported family (TINY_ARCHS), float32."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, vocab, layers, tied)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        # Random init gives near-uniform logits; sharpen them so greedy ties are rare and
        # acceptance is non-trivial in tests.
        model.lm_head.weight.mul_(8.0)
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):  # zero at init: make the biases count
                p.normal_(0.0, 0.5)
    return model.eval()


def tiny_tokenizer(vocab: int = TINY_VOCAB, pieces: bool = False):
    """A word-level tokenizer over the tiny vocabulary, with a chat template. `pieces`: its
    tokens are `tiny_pieces` instead, decoded by plain concatenation, so that the tiny models
    can write JSON (grammar tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = tiny_pieces(vocab) if pieces else ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if pieces:
        tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w3 {% endif %}"
    )
    return fast


# The text of the tiny vocabulary's first tokens for grammar tests (speculative/grammar.py): JSON's
# punctuation, a few values and words, so that the tiny models can write JSON; and the letters of
# every word a test's grammar spells ("name", "arguments", "true", "null"), because a grammar
# allows any token that starts a word, and a vocabulary that cannot finish it is a dead end.
GRAMMAR_PIECES = ("{", "}", "[", "]", ":", ",", '"', " ", "a", "b", "0", "1", "true", "null",
                  '{"', '":', '"a"', "\n", "name", "arguments",
                  "n", "m", "e", "r", "g", "u", "t", "s", "l")


def tiny_pieces(vocab: int = TINY_VOCAB) -> list[str]:
    """Each tiny token's raw text: the specials, GRAMMAR_PIECES, then `w<i>`."""
    head = ["<unk>", "<s>", "</s>", *GRAMMAR_PIECES]
    return head + [f"w{i}" for i in range(len(head), vocab)]


def make_tiny_target(out_dir: str | Path, arch: str = "llama", seed: int = 0,
                     vocab: int = TINY_VOCAB) -> str:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tiny_hf_model(arch, seed, vocab).save_pretrained(out)
    tiny_tokenizer(vocab).save_pretrained(out)
    return str(out)


def make_tiny_pair(
    tmp_dir: str | Path, arch: str = "llama", seed: int = 0, block_size: int = 4,
    layer_ids: tuple[int, ...] = (0, 3), delta_std: float = 0.02, min_block: int = 0,
    store: str = "float", vocab: int = TINY_VOCAB,
) -> tuple[str, str]:
    """(target_dir, drafter_dir): a tiny random target and a drafter over two of its layers
    with small random deltas (so mask slots differ from the plain layers), agreeing with the
    target often enough to exercise every path. min_block > 0: marked as trained on mixed
    blocks down to that size (as the shipped drafter: block 16, min_block_size 4). store: how
    the checkpoint keeps the deltas (models/delta_store.py; the shipped one: int4)."""
    from sglang_d3d.models.drafter import D3DDrafter
    from sglang_d3d.models.loading import load_hf_model

    root = Path(tmp_dir)
    target_dir = make_tiny_target(root / "target", arch, seed, vocab)
    from sglang_d3d.models.decoder import Decoder

    target = Decoder.from_hf(load_hf_model(Path(target_dir)))
    drafter = D3DDrafter.init_from_target(target, list(layer_ids), block_size, rank=4, alpha=4.0,
                                          min_block=min_block)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in drafter.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * delta_std)
    drafter_dir = root / "drafter"
    drafter.save_pretrained(drafter_dir, store=store)
    return target_dir, str(drafter_dir)
