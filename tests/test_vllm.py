"""The vllm backend: vLLM's own LoRA ops under vLLM's own dispatch rules.

Without vLLM installed these tests skip (CI installs no vLLM), except those that check what a
user without it sees. With it (``pip install 'lorabench[vllm]'``, or the bundle on the H200) they
run vLLM's kernels: in Triton's interpreter on the CPU, as real CUDA graphs on a GPU.
"""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
from lorabench.kernels import RANKS, reference, vllm_lora

from lorabench.cli import main
from lorabench.config.flags import Machine
from lorabench.config.spec import build_spec
from lorabench.config.strategies import strategy
from lorabench.errors import UserError
from lorabench.runtime.vllm_rules import (
    captured_lora_counts,
    dummy_mapping,
    vllm_counts,
)

needs_vllm = pytest.mark.skipif(not vllm_lora.available(), reason=vllm_lora.INSTALL_HINT)


def vllm_function(relpath: str, name: str):
    """One function of the installed vLLM, compiled from its source alone (importing its module
    would pull most of vLLM in)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(vllm_lora.INSTALL_HINT)
    source = (Path(spec.submodule_search_locations[0]) / relpath).read_text()
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope: dict = {}
    exec(compile(ast.Module([fn], []), relpath, "exec"), scope)
    return scope[name]


@pytest.mark.parametrize("max_loras", [1, 2, 3, 4, 6, 8, 32, 128])
@pytest.mark.parametrize("specialize", [False, True])
def test_capture_counts_are_vllms(max_loras, specialize):
    theirs = vllm_function("lora/utils.py", "get_captured_lora_counts")
    assert captured_lora_counts(max_loras, specialize) == theirs(max_loras, specialize)


def test_strategies_map_to_vllm_keys():
    assert vllm_counts(strategy("max"), 4) == [5]
    assert vllm_counts(strategy("pow2"), 4) == [1, 2, 4, 5]
    assert vllm_counts(strategy("pow2"), 6) == [1, 2, 4, 7]  # vLLM's own list, not lorabench's [1,2,4,6]
    assert vllm_counts(strategy("dense"), 3) == [1, 2, 3, 4]
    assert vllm_counts(strategy("[2,4]"), 4) == [2, 4, 5]


def test_dummy_capture_batches():
    assert dummy_mapping(4, 0, 4) == [-1] * 4
    assert dummy_mapping(8, 2, 4) == [0, 1] * 4
    assert dummy_mapping(3, 5, 4) == [0, 1, 2]  # key max_loras+1: every slot, no base request


def test_without_vllm_one_line_says_how_to_get_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(vllm_lora, "_OPS", None)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    from lorabench.runtime.env import require_vllm

    with pytest.raises(UserError, match=r"pip install 'lorabench\[vllm\]'"):
        require_vllm()
    code = main(["sweep", "--kernels", "vllm", "--dtype", "float16", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "lorabench[vllm]" in err[0]


def test_vllm_needs_half_precision():
    with pytest.raises(UserError, match="float16 or bfloat16"):
        build_spec({"kernels": "vllm", "dtype": "float32"}, None, Machine(cuda=HAS_CUDA))


SLOTS = [2, -1, 0, 2, -1, 1]  # three adapters and two base-model requests


def vllm_against_reference(slices, a_rows: int, rank: int, out_width: int | None = None, seed: int = 0,
                           strategy_name: str = "pow2"):
    """vLLM's shrink + expand through this backend against the reference on SLOTS: A of
    ``a_rows`` rows per slice (the rank, or a fully sharded rank's share of it), B of ``rank``,
    y ``out_width`` wide (default: the slices'; wider: only the slices' columns change).
    Returns the rules (their grid is vLLM's)."""
    from lorabench.runtime.vllm_rules import VllmRules

    torch.manual_seed(seed)
    L, K, T = 3, 64, len(SLOTS)
    starts = tuple(sum(slices[:i]) for i in range(len(slices) + 1))
    a = torch.randn(L, len(slices) * a_rows, K, device=DEVICE, dtype=torch.float16) / 8
    b = torch.randn(L, starts[-1], rank, device=DEVICE, dtype=torch.float16) / (2 * rank**0.5)
    x = torch.randn(T, K, device=DEVICE, dtype=torch.float16)
    rules = VllmRules(strategy(strategy_name), L, 8, DEVICE)
    rules.load(SLOTS)
    y = torch.randn(T, out_width or starts[-1], device=DEVICE, dtype=torch.float16)
    want = y.float().clone()
    want[:, : starts[-1]] += reference.lora_delta(x, a, b, starts, torch.tensor(SLOTS, device=DEVICE), 0.5)
    vllm_lora.lora_apply(y, x, a, b, starts, rules.meta, 1, 0.5)
    torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=2e-2)
    return rules


@needs_vllm
@pytest.mark.parametrize("slices", [(48,), (32, 16, 16)])
@pytest.mark.parametrize("R", RANKS)
def test_vllm_ops_match_the_reference(slices, R):
    """vLLM's shrink + expand through this backend, on a batch mixing base and adapter tokens,
    at every rank vLLM allows."""
    rules = vllm_against_reference(slices, R, R)
    assert rules.grid(len(SLOTS)) == 4  # 3 adapters + the base id -1, rounded up in [1, 2, 4]


@needs_vllm
@pytest.mark.parametrize("slices", [(48,), (32, 16, 16)])
def test_vllm_ops_fully_sharded_match_the_reference(slices):
    """A column-parallel rank of fully sharded LoRA at TP 4 (R / 4 rows of each slice's A; the
    other ranks' shares of the gathered shrink output count as zero)."""
    vllm_against_reference(slices, 16 // 4, 16, seed=1, strategy_name="max")


@needs_vllm
def test_vllm_ops_fully_sharded_row_parallel_update_the_ranks_share():
    """A row-parallel rank of fully sharded LoRA: B holds hidden / TP outputs; the update lands in
    the first hidden / TP columns of y (rank 0's share, vLLM's offset_start 0), the rest untouched."""
    vllm_against_reference((48,), 16, 16, out_width=96, seed=2, strategy_name="max")


@needs_vllm
def test_vllm_runner_rules_give_the_right_grids():
    from lorabench.runtime.vllm_rules import VllmRules

    r = VllmRules(strategy("pow2"), 4, 8, DEVICE)
    assert r.keys(8) == [5, 4, 2, 1, 0]  # every key, every size: what vLLM captures
    assert [r.key(n) for n in range(5)] == [0, 1, 2, 4, 4]
    assert r.arm(8, 2) == 2 and r.arm(8, 4) == 4 and r.arm(8, 5) == 4 and r.arm(1, 4) == 1 and r.arm(8, 0) == 0
    r.load([0, -1, 1])
    assert r.grid(3) == 4  # eager: -1, 0, 1 -> 3, rounded up to 4
    m = VllmRules(strategy("max"), 4, 8, DEVICE)
    assert [m.key(n) for n in range(5)] == [0, 5, 5, 5, 5] and m.arm(2, 5) == 5


@needs_vllm
def test_check_verdicts_on_vllm_rules():
    """vLLM's default (one key, grid max_loras+1) is correct; with --specialize-active-lora, the
    smallest batch mixing one adapter with a base request replays a grid-1 graph whose only
    program takes the base id -1: the adapter token gets no update."""
    from lorabench.config.models import resolve
    from lorabench.runtime.check import check
    from lorabench.runtime.dispatch import Dispatcher
    from lorabench.runtime.model import LlamaLoRA
    from lorabench.runtime.vllm_rules import VllmRules

    verdicts = {}
    for name in ("max", "pow2"):
        model = LlamaLoRA(resolve("tiny", 1), max_loras=2, rank=16, max_tokens=2, context_len=8,
                          dtype=torch.float16, device=DEVICE)
        d = Dispatcher(model, vllm_lora, max_loras=2, capture_sizes=[1, 2], counts=None, use_graphs=HAS_CUDA,
                       rules=VllmRules(strategy(name), 2, 2, DEVICE))
        d.warm_up()
        d.capture()
        verdicts[name] = check(d, "float16", seed=1)
    assert verdicts["max"].correct is True, verdicts["max"].detail
    v = verdicts["pow2"]
    assert v.correct is False
    assert sorted(v.first.slots) == [-1, 0] or sorted(v.first.slots) == [-1, 1], v.detail
    assert (v.first.graph_tokens, v.first.key, v.first.grid) == (2, 1, 1)


@needs_vllm
def test_check_verdicts_on_vllm_rules_for_mixed_steps():
    """vLLM keys its PIECEWISE graphs (mixed prefill/decode steps) by active count too: its default
    passes every mixed key; with --specialize-active-lora a mixed step of one adapter's requests
    beside a base request replays the key-1 pieces, whose one program takes the base id -1, and the
    check names that smallest mixed step apart from the decode batch that fails first."""
    from lorabench.config.models import resolve
    from lorabench.runtime.check import check
    from lorabench.runtime.dispatch import Dispatcher
    from lorabench.runtime.model import LlamaLoRA
    from lorabench.runtime.vllm_rules import VllmRules

    verdicts = {}
    for name in ("max", "pow2"):
        model = LlamaLoRA(resolve("tiny", 1), max_loras=2, rank=16, max_tokens=4, context_len=8,
                          dtype=torch.float16, device=DEVICE, cache_rows=8)
        d = Dispatcher(model, vllm_lora, max_loras=2, capture_sizes=[1, 2], counts=None, use_graphs=HAS_CUDA,
                       rules=VllmRules(strategy(name), 2, 4, DEVICE), mixed_sizes=[2, 4])
        d.warm_up()
        d.capture()
        d.capture_mixed()
        verdicts[name] = check(d, "float16", seed=1)
    ok = verdicts["max"]
    assert ok.correct is True and ok.mixed_graphs_checked == ok.mixed_graphs_total > 0, ok.detail
    v = verdicts["pow2"]
    assert v.correct is False and v.failing_mixed_graphs, v.detail
    step = v.first_mixed
    assert step is not None and step.pieces and step.graphed and (step.key, step.grid) == (1, 1), v.detail
    assert {s for s, *_ in step.pieces} in ({-1, 0}, {-1, 1})  # one adapter beside the base model
    assert "smallest mixed step: mixed step [" in v.detail


@needs_vllm
def test_importing_vllm_leaves_torch_switches_alone():
    """vLLM's import turns cuDNN attention off process-wide (its CUDA platform module); the
    backend puts it back, so only the LoRA ops differ between backends. A fresh process: vLLM
    cannot be imported twice in one."""
    code = ("import torch; from lorabench.kernels import vllm_lora as v; b = v._torch_flags(); v.load_ops()\n"
            "if torch.cuda.is_available(): import vllm.platforms.cuda  # the module that flips the switch\n"
            "print(b == v._torch_flags())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1:] == ["True"], out.stderr[-2000:]
