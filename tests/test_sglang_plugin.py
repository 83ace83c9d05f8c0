"""D3D as an SGLang plugin: the entry point, registration, the algorithm object the scheduler
dispatches on, and SGLang's own argument pipeline selecting our worker. CPU, real sglang 0.5.23
(import shims from sglang_d3d.sglang_worker.cpu_harness)."""

from __future__ import annotations

import re
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from sglang_d3d.sglang_worker.cpu_harness import install

install()
sglang = pytest.importorskip("sglang")

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from sglang_d3d.sglang_worker import plugin  # noqa: E402
from sglang_d3d.sglang_worker.spec_algo import D3DSpecAlgo  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from sglang_d3d.sglang_worker.cpu_harness.tiny import make_pair

    return make_pair(tmp_path_factory.mktemp("pair"), block_size=4)


def test_entry_point_resolves_to_register():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "d3d"]
    assert len(eps) == 1
    assert eps[0].load() is plugin.register


def test_sglang_plugin_loader_registers_d3d():
    from sglang.srt.plugins import load_plugins

    load_plugins()  # SGLang's own loader: discovers our entry point and calls it
    algo = SpeculativeAlgorithm.from_string("d3d")
    assert isinstance(algo, D3DSpecAlgo)
    assert algo.name == "D3D" and algo.is_speculative() and not algo.is_eagle()


def test_register_is_idempotent():
    plugin.register()
    plugin.register()  # SGLang itself refuses a second registration; ours must not raise
    assert isinstance(SpeculativeAlgorithm.from_string("D3D"), D3DSpecAlgo)


def test_algorithm_has_every_method_sglang_calls_on_an_algorithm():
    """Scan SGLang's source for `<algorithm>.<method>(` calls and check D3DSpecAlgo answers
    each one the builtin enum answers (0.5.23's CustomSpecAlgo lacks three of them)."""
    root = Path(sglang.__file__).parent / "srt"
    pattern = re.compile(r"(?:spec_algorithm|spec_algo|speculative_algorithm|algo)\.([a-z_]+)\(")
    called = {m for f in root.rglob("*.py") for m in pattern.findall(f.read_text())}
    enum_methods = {name for name in vars(SpeculativeAlgorithm) if not name.startswith("_")}
    needed = called & enum_methods
    assert {"create_future_map", "need_topk", "is_none"} <= needed  # the scan found calls
    missing = sorted(m for m in needed if not hasattr(D3DSpecAlgo, m))
    assert missing == []


def test_future_map_builds_on_a_real_pool():
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(size=4, max_context_len=32, device="cpu", enable_memory_saver=False)
    fm = SpeculativeAlgorithm.from_string("D3D").create_future_map("cpu", pool)
    assert isinstance(fm, FutureMap) and fm.req_pool_size == 5


def _resolved(argv):
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(argv)
    args.resolve_once()
    return args, resolving_view(args)


def _argv(pair, *extra):
    target, drafter = pair
    return [
        "--model-path", target,
        "--speculative-algorithm", "D3D",
        "--speculative-draft-model-path", drafter,
        "--device", "cpu",
        "--attention-backend", "torch_native",
        *extra,
    ]  # fmt: skip


def test_launch_arguments_select_the_d3d_worker(pair):
    from sglang_d3d.sglang_worker.worker import D3DWorker

    plugin.register()
    args, view = _resolved(_argv(pair))
    assert view.speculative_algorithm == "D3D"
    # block size from the drafter's config; a chain: topk 1, steps = block - 1
    assert (view.speculative_num_draft_tokens, view.speculative_eagle_topk) == (4, 1)
    assert view.speculative_num_steps == 3
    assert view.disable_overlap_schedule and view.disable_cuda_graph
    algo = SpeculativeAlgorithm.from_string(view.speculative_algorithm)
    assert algo.create_worker(args) is D3DWorker


def test_block_size_flag_overrides_the_drafter_default(pair):
    plugin.register()
    _, view = _resolved(_argv(pair, "--speculative-num-draft-tokens", "6"))
    assert (view.speculative_num_draft_tokens, view.speculative_num_steps) == (6, 5)


def test_sglang_argument_pipeline_reports_our_refusal(pair):
    from sglang_d3d.sglang_worker.validation import D3DArgumentError

    plugin.register()
    with pytest.raises(D3DArgumentError, match="--page-size 16"):
        _resolved(_argv(pair, "--page-size", "16"))


@pytest.fixture
def published(monkeypatch):
    """Publish resolved server args into SGLang's runtime context (what its model runner reads),
    and put the previous context back afterwards."""
    from sglang.srt.runtime_context import get_context

    ctx = get_context()
    saved = ctx._server_args, ctx._config_bags
    yield lambda args: ctx.set_server_args(args)
    ctx._server_args, ctx._config_bags = saved


def _gpu_graph_defaults(monkeypatch):
    """On CPU, SGLang defaults prefill graphs to disabled; on CUDA to breakable. Resolve as CUDA
    would, so the test sees the prefill phase D3D has to switch off too."""
    import sglang.srt.model_executor.cuda_graph_config as cgc

    monkeypatch.setattr(cgc, "default_prefill_backend", lambda: cgc.Backend.BREAKABLE)


def test_cuda_graphs_are_off_in_the_config_sglang_publishes(pair, published, monkeypatch):
    """Resolved for CUDA + flashinfer, SGLang's graph config must have every phase
    disabled, not just the legacy flag set after the config was built."""
    from sglang.srt.model_executor.cuda_graph_config import (
        Backend,
        Phase,
        check_cuda_graph_backend,
        cuda_graph_fully_disabled,
    )

    _gpu_graph_defaults(monkeypatch)
    plugin.register()
    cuda = ["--device", "cuda", "--attention-backend", "flashinfer"]
    target, drafter = pair
    plain, _ = _resolved(["--model-path", target, *cuda])
    published(plain)  # without D3D: the graphs SGLang would capture
    assert check_cuda_graph_backend(Phase.DECODE, Backend.FULL)
    assert check_cuda_graph_backend(Phase.PREFILL, Backend.BREAKABLE)
    d3d, view = _resolved(
        ["--model-path", target, "--speculative-algorithm", "D3D",
         "--speculative-draft-model-path", drafter, *cuda]
    )  # fmt: skip
    assert view.attention_backend == "flashinfer"
    published(d3d)
    assert cuda_graph_fully_disabled()  # the predicate SGLang's runners ask
    assert view.cuda_graph_config.decode.max_bs == 160  # other graph settings left alone


def test_running_requests_get_a_drafter_sized_default(pair, published):
    """Without --max-running-requests SGLang would size for thousands of requests and
    the worker (built before SGLang's pools) saw None. D3D declares its own default, which the
    worker reads from the published schedule; an explicit value is kept."""
    from sglang.srt.runtime_context import get_schedule

    from sglang_d3d.sglang_worker.validation import DEFAULT_MAX_RUNNING_REQUESTS

    plugin.register()
    args, view = _resolved(_argv(pair))
    assert view.max_running_requests == DEFAULT_MAX_RUNNING_REQUESTS
    published(args)
    assert get_schedule().max_running_requests == DEFAULT_MAX_RUNNING_REQUESTS
    _, view = _resolved(_argv(pair, "--max-running-requests", "5"))
    assert view.max_running_requests == 5



def test_a_failed_registration_prints_its_cause(monkeypatch, capsys):
    """SGLang's loader swallows a plugin's exception; the cause must still reach the user."""

    def broken():
        raise ImportError("no module named 'sglang_d3d.models.missing'")

    monkeypatch.setattr(plugin, "_register", broken)
    with pytest.raises(ImportError):
        plugin.register()
    err = capsys.readouterr().err
    assert "registering --speculative-algorithm D3D failed" in err
    assert "sglang_d3d.models.missing" in err


def test_registered_without_the_deprecated_no_overlap_path(pair, caplog):
    """supports_overlap=False is deprecated in SGLang 0.5.23 (a warning at every start); D3D
    switches the overlap schedule off itself, so the worker still runs synchronously."""
    from sglang.srt.speculative.spec_registry import get_spec

    plugin.register()
    assert get_spec("D3D").supports_overlap
    args, view = _resolved(_argv(pair))
    assert view.disable_overlap_schedule
    with caplog.at_level("WARNING"):
        SpeculativeAlgorithm.from_string("D3D").create_worker(args)
    assert "deprecated" not in caplog.text


def test_tensor_parallelism_passes_sglangs_pipeline(pair):
    plugin.register()
    _, view = _resolved(_argv(pair, "--tp-size", "2"))
    assert view.tp_size == 2 and view.speculative_algorithm == "D3D"
