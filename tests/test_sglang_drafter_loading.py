"""The drafter beside SGLang's target (sglang_worker/drafter_loading.py): where it runs, and when
it shares SGLang's embedding and LM head instead of loading its own. No sglang import needed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_d3d.sglang_worker.drafter_loading import (
    build_drafter,
    concrete_device,
    placement,
    shared_target_weights,
)

V, H = 96, 16


def _sglang_like_model(padded_vocab: int = 128):
    """What the worker reads of SGLang's model: model.embed_tokens.weight, lm_head.weight, both
    with the vocabulary padded."""
    embed = torch.randn(padded_vocab, H)
    head = torch.randn(padded_vocab, H)
    return SimpleNamespace(model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=embed)),
                           lm_head=SimpleNamespace(weight=head))


def test_a_bare_cuda_is_the_workers_gpu():
    assert concrete_device("cuda", 3) == torch.device("cuda", 3)
    assert concrete_device("cuda:1", 3) == torch.device("cuda", 1)
    assert concrete_device("cpu", 3) == torch.device("cpu")


def test_sglangs_cuda_and_the_drafters_cuda_n_share_the_embedding_and_head():
    """SGLang's model runner says "cuda"; the drafter's default device is that same GPU, as
    "cuda:N". Compared as given they differed, and the drafter loaded its own copies."""
    model = _sglang_like_model()
    for draft_option in ("", "cuda", "cuda:2"):
        target, draft = placement("cuda", draft_option, gpu_id=2)
        assert target == draft == torch.device("cuda", 2)
        embed, head = shared_target_weights(model, V, 1, target, draft)
        assert embed is not None and head is not None
        assert embed.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # a view
        assert embed.shape == head.shape == (V, H)  # the padding dropped


def test_no_sharing_across_devices_or_ranks():
    model = _sglang_like_model()
    target, draft = placement("cuda", "cuda:1", gpu_id=0)
    assert shared_target_weights(model, V, 1, target, draft) == (None, None)
    target, draft = placement("cuda", "", gpu_id=0)
    assert shared_target_weights(model, V, 2, target, draft) == (None, None)  # sharded


def test_the_drafter_uses_the_shared_tensors_themselves(tmp_path):
    from sglang_d3d.sglang_worker.cpu_harness.tiny import make_pair

    target_dir, drafter_dir = make_pair(tmp_path, block_size=4)
    embed, head = torch.randn(V, 64), torch.randn(V, 64)  # the tiny target's hidden size
    drafter = build_drafter(drafter_dir, target_dir, "cpu", torch.float32, embed, head)
    shared = drafter._shared  # the target's modules the drafter reads (models/drafter.py)
    assert shared["embed"].weight.data_ptr() == embed.data_ptr()  # no copy was made
    assert shared["head"].weight.data_ptr() == head.data_ptr()


def _resave(target_dir: str, edit) -> None:
    """Rewrite the target's safetensors through `edit(dict) -> dict`."""
    from safetensors.torch import load_file, save_file

    path = Path(target_dir) / "model.safetensors"
    save_file(edit(load_file(str(path))), str(path), metadata={"format": "pt"})


def test_a_renamed_checkpoint_is_refused_not_left_uninitialised(tmp_path):
    """The source layers are materialised empty and filled from the safetensors; keys named
    otherwise (a multimodal wrapper) would leave them as uninitialised memory."""
    from sglang_d3d.sglang_worker.cpu_harness.tiny import make_pair

    target_dir, drafter_dir = make_pair(tmp_path, block_size=4)
    _resave(target_dir, lambda t: {k.replace("model.layers.", "model.language_model.layers."): v
                                   for k, v in t.items()})
    with pytest.raises(FileNotFoundError, match="named otherwise"):
        build_drafter(drafter_dir, target_dir, "cpu", torch.float32)


def test_a_quantised_checkpoint_is_refused(tmp_path):
    from sglang_d3d.sglang_worker.cpu_harness.tiny import make_pair

    target_dir, drafter_dir = make_pair(tmp_path, block_size=4)
    cfg_file = Path(target_dir) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match="quantised checkpoint \\(fp8\\)"):
        build_drafter(drafter_dir, target_dir, "cpu", torch.float32)
    cfg_file.write_text(json.dumps(cfg))  # config clean, but int8 tensors in the files
    _resave(target_dir, lambda t: {k: (v.to(torch.int8) if ".layers.0." in k else v)
                                   for k, v in t.items()})
    with pytest.raises(ValueError, match="quantised or reshaped"):
        build_drafter(drafter_dir, target_dir, "cpu", torch.float32)
