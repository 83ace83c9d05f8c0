"""SGLang alone's output kept between real-SGLang comparisons (cpu_harness/compare.py
`kept_baseline`): read back for the same target files and settings, computed again for any
other; off without SGLANG_D3D_BASELINE_CACHE. SGLang itself is stood in for."""

from __future__ import annotations

from sglang_d3d.sglang_worker.cpu_harness import compare


def _target(root, weights: bytes):
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(weights)
    return str(root)


def test_the_baseline_is_read_back_for_the_same_files_and_settings(tmp_path, monkeypatch):
    runs = []

    def baseline(target, prompts, max_new, device, dtype, tp=1):
        runs.append((target, max_new))
        return [[len(runs)] * max_new for _ in prompts]

    monkeypatch.setattr(compare, "baseline", baseline)
    monkeypatch.setenv("SGLANG_D3D_BASELINE_CACHE", str(tmp_path / "kept"))
    a, b = _target(tmp_path / "a", b"w1"), _target(tmp_path / "b", b"w1")  # same files, two folders
    c = _target(tmp_path / "c", b"w2")
    first = compare.kept_baseline(a, [[1, 2]], 3, "cpu", "float32")
    assert compare.kept_baseline(b, [[1, 2]], 3, "cpu", "float32") == first == [[1, 1, 1]]
    assert len(runs) == 1
    compare.kept_baseline(c, [[1, 2]], 3, "cpu", "float32")  # other weights
    compare.kept_baseline(a, [[1, 2]], 4, "cpu", "float32")  # another length
    compare.kept_baseline(a, [[1, 2]], 3, "cpu", "float32", tp=2)  # other ranks
    assert len(runs) == 4
    monkeypatch.delenv("SGLANG_D3D_BASELINE_CACHE")
    compare.kept_baseline(a, [[1, 2]], 3, "cpu", "float32")  # off: SGLang runs every time
    assert len(runs) == 5
