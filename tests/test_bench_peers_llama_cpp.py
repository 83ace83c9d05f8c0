"""bench_peers.py's llama-cpp row: the request and answer lines of benchmarks/llama_decode.cpp,
the process that carries them, and the agreement counts beside d3d `ar`. With the program built
(scripts/build_llama_decode.sh) and llama-cpp-python installed, its greedy ids are checked
against the binding's on the same library."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ld = _module("llama_decode")


def test_command_passes_threads_model_and_stop_ids():
    cmd = ld.command(Path("bin/llama_decode"), Path("m.gguf"), 2, (2, 0))
    assert cmd == ["bin/llama_decode", "--model", "m.gguf", "--threads", "2", "--eos", "2,0"]
    assert "--eos" not in ld.command(Path("b"), Path("m"), 1, ())


def test_request_line_is_budget_then_prompt_ids():
    assert ld.request_line([1, 9690, 198], 16) == "16 1 9690 198\n"
    with pytest.raises(ValueError):
        ld.request_line([], 16)
    with pytest.raises(ValueError):
        ld.request_line([1], 0)


def test_parse_answer_rejects_a_line_without_every_field():
    line = json.dumps({"prompt_tokens": 3, "ttft_s": 0.01, "seconds": 0.2, "decode_tokens_per_s": 80.0,
                       "token_ids": [5, 6]})
    assert ld.parse_answer(line)["token_ids"] == [5, 6]
    with pytest.raises(ValueError, match="seconds"):
        ld.parse_answer(json.dumps({"prompt_tokens": 3, "ttft_s": 0.01, "decode_tokens_per_s": 1.0,
                                    "token_ids": []}))


def _fake_program(tmp_path: Path) -> list[str]:
    """Speaks llama_decode's protocol: answers N copies of the prompt's last id; exits on N = 99."""
    script = tmp_path / "fake_decode.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        for line in sys.stdin:
            n, *ids = map(int, line.split())
            if n == 99:
                sys.exit(2)
            print(json.dumps({"prompt_tokens": len(ids), "ttft_s": 0.001, "seconds": 0.002,
                              "decode_tokens_per_s": 1.0, "token_ids": [ids[-1]] * n}), flush=True)
    """))
    return [sys.executable, str(script)]


def test_one_process_answers_requests_in_order_and_reports_its_exit(tmp_path):
    proc = ld.LlamaDecode(_fake_program(tmp_path))
    assert proc.generate([4, 7], 3)["token_ids"] == [7, 7, 7]
    assert proc.generate([5], 1)["token_ids"] == [5]
    with pytest.raises(RuntimeError, match="status 2"):
        proc.generate([1], 99)
    proc.close()


def test_agreement_with_ar_counts_equal_outputs_and_their_common_prefix():
    bp = _module("bench_peers")
    assert bp.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert bp.common_prefix([1, 2], [1, 2, 3]) == 2 and bp.common_prefix([], [1]) == 0
    run = lambda ids: {"tokens": len(ids), "seconds": 1.0, "ttft": 0.1, "accepted_length": None,  # noqa: E731
                       "token_ids": ids}
    results = {"d3d-ar": [run([1, 2, 3]), run([4, 5])], "llama-cpp": [run([1, 2, 3]), run([4, 6])],
               "llama": [run([1, 2, 3]), run([4, 6])]}
    s = bp._summary("llama-cpp", results["llama-cpp"], results)
    assert (s["same_as_ar"], s["prefix_with_ar"], s["same_as_plain"]) == (1, 2.0, 2)
    assert bp._summary("d3d-ar", results["d3d-ar"], results)["same_as_ar"] is None


def _built_program():
    if not ld.DEFAULT_BINARY.is_file():
        pytest.skip(f"{ld.DEFAULT_BINARY.name} is not built (scripts/build_llama_decode.sh)")
    from sglang_d3d.models import loading

    try:
        return ld.DEFAULT_BINARY, loading.find_default_gguf()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"the default target's GGUF is not installed: {e}")


def test_program_rejects_a_request_without_new_tokens():
    binary, gguf = _built_program()
    out = subprocess.run([str(binary), "--model", str(gguf), "--threads", "1"], input="0 1 2\n",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "at least 1" in out.stderr


def test_program_decodes_the_same_greedy_ids_as_the_python_binding():
    binary, gguf = _built_program()
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (make bench-peers) is not installed")
    prompt = [1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198]
    proc = ld.LlamaDecode(ld.command(binary, gguf, 1, ()))
    try:
        ours = [proc.generate(prompt, 12) for _ in range(2)]
    finally:
        proc.close()
    llm = llama_cpp.Llama(str(gguf), n_ctx=2048, n_threads=1, n_threads_batch=1, verbose=False)
    theirs = []
    for t in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        theirs.append(int(t))
        if len(theirs) == 12:
            break
    assert ours[0]["token_ids"] == ours[1]["token_ids"] == theirs  # the cache is cleared per request
    assert ours[0]["prompt_tokens"] == len(prompt) and 0 < ours[0]["ttft_s"] < ours[0]["seconds"]
