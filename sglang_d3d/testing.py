"""Tiny random model pairs for tests: built in seconds, saved like real checkpoints.

Never downloads anything; the configs are written here.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VOCAB = 96


def tiny_hf_model(
    arch: str = "llama", seed: int = 0, vocab: int = TINY_VOCAB, layers: int = 4, tied: bool = True
):
    """A random Llama or Qwen3 causal LM with a small vocabulary (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    # Random init gives near-uniform logits; sharpen them so greedy ties are rare and
    # acceptance is non-trivial in tests.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
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


def make_tiny_target(out_dir: str | Path, arch: str = "llama", seed: int = 0) -> str:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tiny_hf_model(arch, seed).save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return str(out)


def make_tiny_pair(
    tmp_dir: str | Path, arch: str = "llama", seed: int = 0, block_size: int = 4,
    layer_ids: tuple[int, ...] = (0, 3), delta_std: float = 0.02, min_block: int = 0,
    store: str = "float",
) -> tuple[str, str]:
    """(target_dir, drafter_dir): a tiny random target and a drafter over two of its layers
    with small random deltas (so mask slots differ from the plain layers), agreeing with the
    target often enough to exercise every path. min_block > 0: marked as trained on mixed
    blocks down to that size (as the shipped drafter: block 16, min_block_size 4). store: how
    the checkpoint keeps the deltas (models/delta_store.py; the shipped one: int4)."""
    from sglang_d3d.models.drafter import D3DDrafter
    from sglang_d3d.models.loading import load_hf_model

    root = Path(tmp_dir)
    target_dir = make_tiny_target(root / "target", arch, seed)
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
