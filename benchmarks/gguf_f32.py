"""An all-fp32 GGUF of the default target, for llama.cpp: the exact peer of d3d's fp32 path.

Every tensor of the shipped Q4_1 file dequantised with the `gguf` package (the same values
transformers loads for d3d's fp32 target), and every metadata key (tokenizer, chat template,
hyper-parameters) copied, with the file type set to all-F32. Written once to the cache:

    .venv/bin/python benchmarks/gguf_f32.py    # prints the path
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sglang_d3d.models import loading

ALL_F32 = 0  # llama.cpp's LLAMA_FTYPE_ALL_F32


def f32_gguf_path() -> Path:
    """The fp32 GGUF in the cache, written on first use."""
    out = loading.cache_dir() / "SmolLM2-135M-Instruct.F32.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        write_f32_gguf(loading.find_default_gguf(), tmp)
        tmp.rename(out)  # atomic: a half-written file is never taken for the model
    return out


def write_f32_gguf(src: Path, dst: Path) -> None:
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants

    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        value = ALL_F32 if name == "general.file_type" else field.contents()
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    print(f32_gguf_path())
