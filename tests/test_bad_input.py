"""Bad input, for every command: exit status 2, exactly one line on stderr (``error: ...``), no
traceback, and nothing written: a results folder holding an earlier run is byte-identical after
the command, and no other file or folder appears.

Cases run the CLI in-process (``lorabench.cli.main``) in a temporary folder that holds an earlier
run (frozen H200 rows from tests/data); a handful run the real ``python -m lorabench`` process.
Memory limits are tested against a machine with a fixed amount of free memory, and against this
one with figures no machine has.
"""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import H200_CARD, HAS_CUDA

import numpy as np
from peft_folders import PREFIX, adapter_files, module_tensors

from lorabench.cli import main
from lorabench.commands import sweep as sweep_module
from lorabench.config import spec as spec_module
from lorabench.config.flags import Machine
from lorabench.errors import UserError
from lorabench.runtime import env

RUN = "20240101-000000-cuda"  # the earlier run, under results/
RNG = np.random.default_rng(0)
LONE_A = np.zeros((8, 128), dtype=np.float32)
GiB = 2**30


@dataclass(frozen=True)
class Case:
    argv: list[str]  # "{results}", "{run}" and "{tmp}" are filled in
    needle: str  # must be in the error line
    files: dict[str, str | bytes] = field(default_factory=dict)  # written under {tmp} first
    free_gib: float | None = None  # run on a machine with this much free memory (None: this machine)
    skip: str | None = None  # a reason this case cannot run here, or None


def sweep(*args: str, **kw) -> Case:
    """A sweep into the earlier run's results folder (nothing may appear there)."""
    return Case(["sweep", "--out", "{results}", *args[:-1]], args[-1], **kw)


def check(*args: str, **kw) -> Case:
    return Case(["check", "--out", "{results}", *args[:-1]], args[-1], **kw)


def spec_file(toml: str | bytes, needle: str, *flags: str, **kw) -> Case:
    """A sweep of a spec file (its `out`, when it has one, else the earlier run's folder)."""
    out = [] if isinstance(toml, str) and toml.startswith("out") else ["--out", "{results}"]
    return Case(["sweep", *out, "--spec", "{tmp}/bad.toml", *flags], needle,
                files={"bad.toml": toml, **kw.pop("files", {})}, **kw)


def trace(content: str | bytes, needle: str, name: str = "t.csv", command: str = "sweep") -> Case:
    argv = {"sweep": ["sweep", "--out", "{results}"], "recommend": ["recommend", "{run}"],
            "sweep-adapters": ["sweep", "--out", "{results}", "--adapters", "2"]}[command]
    return Case([*argv, "--workload", f"trace:{{tmp}}/{name}"], needle, files={name: content})


def _read_only_skip() -> str | None:
    if os.geteuid() == 0:
        return "root writes into read-only folders"
    return None


def _sys_skip() -> str | None:
    try:
        os.rmdir(__import__("tempfile").mkdtemp(dir="/sys"))
    except OSError:
        return None
    return "/sys is writable here"


def _dask_skip(wanted: bool) -> str | None:
    """Skip a --executor dask case where dask.distributed is (wanted=False) or is not (wanted=True) installed."""
    has = importlib.util.find_spec("distributed") is not None
    if has == wanted:
        return None
    return "dask.distributed is not installed" if wanted else "dask.distributed is installed"


STEPS_HEAD = "concurrency,n_active,base_tokens\n"

CASES = {
    # -- sweep flags ------------------------------------------------------------------------
    "sweep concurrency 0": sweep("--concurrency", "0", "--concurrency"),
    "sweep concurrency not a number": sweep("--concurrency", "1,x", "--concurrency"),
    "sweep concurrency negative": sweep("--concurrency", "-2", "--concurrency"),
    "sweep concurrency empty entry": sweep("--concurrency", "1,,2", "--concurrency"),
    "sweep concurrency over 512": sweep("--concurrency", "1024", "512"),
    "sweep capture sizes over 512": sweep("--capture-sizes", "1,1024", "--capture-sizes: at most 512"),
    "sweep max-loras 0": sweep("--max-loras", "0", "--max-loras"),
    "sweep active counts above the slots": sweep("--max-loras", "4", "--active-counts", "1,8",
                                                 "--active-counts: 8 adapters cannot be active with at most 4 slots"),
    "sweep active counts negative": sweep("--active-counts", "-1", "--active-counts"),
    "sweep active counts of no adapter step": sweep("--concurrency", "1,2", "--max-loras", "4", "--active-counts", "0,4",
                                                    "--active-counts: 0,4 measures no adapter step"),
    "sweep active counts with residency": sweep("--active-counts", "1", "--adapters", "8",
                                                "--active-counts: residency runs (--adapters) and strategy auto"),
    "sweep unknown strategy": sweep("--strategy", "fastest", "unknown strategy"),
    "sweep list without max_loras": sweep("--strategy", "[1,2]", "--max-loras", "4", "must contain max_loras"),
    "sweep unknown model": sweep("--model", "gpt-5", "--model: 'gpt-5' is not a preset"),
    "sweep an MoE family not built": sweep("--model", "{tmp}/deepseek.json", "DeepseekV2ForCausalLM; lorabench builds",
                                           files={"deepseek.json": json.dumps({"architectures": ["DeepseekV2ForCausalLM"],
                                                                               "model_type": "deepseek_v2"})}),
    "sweep a MoE model fully sharded": sweep("--model", "tiny-moe", "--tp", "2", "--fully-sharded-loras",
                                             "--fully-sharded-loras"),
    "sweep shared expert weights of a dense model": sweep("--model", "tiny", "--share-expert-weights",
                                                          "--share-expert-weights: tiny has no routed experts to share"),
    "sweep tp that does not split the heads": sweep("--model", "qwen2.5-7b", "--tp", "8", "--tp 8: qwen2.5-7b's 28 attention heads"),
    "sweep tp 0": sweep("--tp", "0", "--tp"),
    "sweep ranks not summing to 1": sweep("--rank", "64", "--ranks", "8:0.5", "--ranks: the shares of '8:0.5' sum to 0.5"),
    "sweep ranks above --rank": sweep("--rank", "16", "--ranks", "64:1", "--ranks: rank 64 is above --rank 16"),
    "sweep unpadded without ranks": sweep("--kernels", "triton+unpadded", "triton+unpadded: needs --ranks"),
    "sweep fully sharded hidden": sweep("--model", "{tmp}/odd.json", "--tp", "4", "--fully-sharded-loras",
                                        "--fully-sharded-loras: odd's hidden size 90 does not split over 4 ranks",
                                        files={"odd.json": '{"architectures": ["MistralForCausalLM"], "model_type": "mistral", '
                                               '"hidden_size": 90, "head_dim": 32, "num_attention_heads": 4, '
                                               '"num_key_value_heads": 4, "num_hidden_layers": 1, '
                                               '"intermediate_size": 256, "vocab_size": 512}'}),
    "sweep a config transformers rejects": sweep("--model", "{tmp}/bad.json", "bad.json: transformers cannot read it (",
                                                 files={"bad.json": '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", '
                                                        '"hidden_size": 90, "num_attention_heads": 4}'}),
    "sweep fully sharded without tp": sweep("--fully-sharded-loras", "--fully-sharded-loras: needs --tp 2 or more"),
    "sweep fully sharded fused": sweep("--model", "llama-3.1-8b", "--tp", "2", "--fully-sharded-loras", "--kernels", "fused",
                                       "--kernels fused cannot run it (one launch has no place for the all-gather",
                                       free_gib=1),  # refused for the flags, before any memory check
    "sweep torch unpadded": sweep("--kernels", "torch+unpadded", "--ranks", "8:1", "--rank", "16", "unknown backend 'torch+unpadded'"),
    "sweep rank 12": sweep("--rank", "12", "--rank"),
    "sweep dtype float8": sweep("--dtype", "float8", "--dtype"),
    "sweep unknown kernels": sweep("--kernels", "cutlass", "--kernels"),
    "sweep device tpu": sweep("--device", "tpu", "--device"),
    "sweep device cuda without a GPU": sweep("--device", "cuda", "no CUDA device",
                                            skip="this machine has a GPU" if HAS_CUDA else None),
    "sweep iters 0": sweep("--iters", "0", "--iters"),
    "sweep iters a million": sweep("--iters", "1000000", "--iters: 1000000 must be at most 100000"),
    "sweep warmup a million": sweep("--warmup", "1000000", "--warmup: 1000000 must be at most 100000"),
    "sweep context-len 0": sweep("--context-len", "0", "--context-len"),
    "sweep seed past 2**32": sweep("--seed", "99999999999999999999", "--seed: 99999999999999999999 must be at most 4294967295"),
    "sweep seed 2**32": sweep("--seed", str(2**32), "must be at most 4294967295"),
    "sweep seed negative": sweep("--seed", "-1", "--seed: -1 must be at least 0"),
    "sweep seed not whole": sweep("--seed", "1.5", "--seed: '1.5' is not an integer"),
    "sweep layers past the preset": sweep("--device", "cpu", "--layers", "100", "--layers: 100 is more than tiny's 2 layers"),
    "sweep layers past llama": sweep("--model", "llama-2-7b", "--device", "cpu", "--layers", "33",
                                     "more than llama-2-7b's 32 layers"),
    "sweep layers 0": sweep("--layers", "0", "--layers: 0 must be at least 1"),
    "sweep spec missing": sweep("--spec", "no/such/spec.toml", "does not exist"),
    "sweep unknown flag": sweep("--no-such-flag", "no-such-flag"),
    "sweep budget without auto": sweep("--strategy", "max", "--graph-memory-budget", "100", "apply to --strategy auto only"),
    "sweep auto without a run": sweep("--strategy", "auto", "needs --auto-from"),
    "sweep tuned folder missing": sweep("--tuned", "{tmp}/no-such-tune", "--tuned: "),
    "sweep tuned folder name too long": sweep("--tuned", "{tmp}/" + "x" * 300, "is not a folder"),
    "sweep tuned kernels without a folder": sweep("--kernels", "fused+tuned", "needs --tuned DIR"),
    # -- sweep --out --------------------------------------------------------------------------
    "sweep out is a file": sweep("--out", "{tmp}/afile", "--out: ", files={"afile": "keep me"}),
    "sweep out below a file": sweep("--out", "{tmp}/afile/sub", "afile is a file", files={"afile": "keep me"}),
    "sweep out /dev/null": sweep("--out", "/dev/null", "--out: /dev/null is not a folder"),
    "sweep out empty": sweep("--out", "", "--out: empty path"),
    "sweep out blank": sweep("--out", "  ", "--out: empty path"),
    "sweep out broken link": sweep("--out", "{tmp}/link", "broken link", files={"link": Path("nowhere")}),
    "sweep out on a read-only mount": sweep("--out", "/sys/lorabench-out", "--out: cannot create folders in /sys",
                                            skip=_sys_skip()),
    "sweep out read-only folder": sweep("--out", "{tmp}/ro/runs", "--out: cannot create folders in",
                                        files={"ro/": 0o555}, skip=_read_only_skip()),
    "sweep out name too long": sweep("--out", "{tmp}/" + "x" * 300, "--out: "),
    # -- workloads ----------------------------------------------------------------------------
    "workload negative zipf": sweep("--workload", "zipf:-1", "--workload"),
    "workload base twice": sweep("--workload", "base:0.5+base:0.3", "names base twice"),
    "workload two distributions": sweep("--workload", "uniform+single", "two adapter distributions"),
    "workload infinite zipf": sweep("--workload", "zipf:inf", "bad workload term 'zipf:inf'"),
    "workload base over 1": sweep("--workload", "base:1.5", "bad workload term"),
    "workload unknown": sweep("--workload", "gauss", "bad workload term 'gauss'"),
    "workload empty entry": sweep("--workload", "uniform,", "--workload: empty entry"),
    "workload trace with a term": sweep("--workload", "trace:x.csv+base:0.5", "alone"),
    "workload trace without a path": sweep("--workload", "trace:", "alone"),
    # -- traces -------------------------------------------------------------------------------
    "trace missing": Case(["sweep", "--out", "{results}", "--workload", "trace:{tmp}/none.csv"], "does not exist"),
    "trace is a folder": Case(["sweep", "--out", "{results}", "--workload", "trace:{tmp}"], "is a folder"),
    "trace n_active not whole": trace(STEPS_HEAD + "1,0.5,0\n", "row 0 needs whole numbers"),
    "trace concurrency not whole": trace(STEPS_HEAD + "1,1,0\n1.5,1,0\n", "row 1 needs whole numbers"),
    "trace n_active over concurrency": trace("concurrency,n_active\n2,3\n", "0 <= n_active <= concurrency"),
    "trace base_tokens negative": trace(STEPS_HEAD + "1,1,-1\n", "whole base_tokens"),
    "trace base_tokens not whole": trace(STEPS_HEAD + "2,1,0.5\n", "whole base_tokens"),
    "trace without known columns": trace("request,lora\n1,a\n", "needs an `adapter` column"),
    "trace without requests": trace("adapter\n", "holds no requests"),
    "trace shorter than the concurrency": trace("adapter\na\nb\n", "has 2 requests, fewer than concurrency 4"),
    "trace steps miss a concurrency": trace("concurrency,n_active\n1,1\n", "no steps at concurrency 2"),
    "trace jsonl not json": trace('{"adapter": \n', "cannot be read as JSONL", name="t.jsonl"),
    "trace binary": trace(b"\xff\xfe\x00garbage\x00", "trace file"),
    "recommend trace n_active not whole": trace(STEPS_HEAD + "1,0.5,0\n", "row 0 needs whole numbers", command="recommend"),
    "recommend trace is a folder": Case(["recommend", "{run}", "--workload", "trace:{tmp}"], "is a folder"),
    # -- spec files ---------------------------------------------------------------------------
    "spec zero concurrency": spec_file("concurrency = [1, 0]", "bad.toml: key `concurrency`: 0 must be at least 1"),
    "spec unknown key": spec_file("bogus = 1", "unknown key"),
    "spec not TOML": spec_file("max-loras = [", "not valid TOML"),
    "spec check not a bool": spec_file('check = "yes"', "bad.toml: key `check`: 'yes' is not true or false"),
    "spec seed past 2**32": spec_file("seed = 4294967296", "bad.toml: key `seed`: 4294967296 must be at most"),
    "spec seed past int64": spec_file("seed = 99999999999999999999", "key `seed`: 99999999999999999999 must be at most"),
    "spec max-loras spelled with a dash": spec_file("max-loras = [0]", "bad.toml: key `max-loras`: 0 must be at least 1"),
    "spec key given twice": spec_file("max-loras = [4]\nmax_loras = [8]", "repeats key `max-loras`"),
    "spec layers past the preset": spec_file('layers = 9\ndevice = "cpu"', "bad.toml: key `layers`: 9 is more than tiny's 2 layers"),
    "spec unknown model": spec_file('model = "gpt-5"', "bad.toml: key `model`: 'gpt-5' is not a preset"),
    "spec rank": spec_file("rank = 12", "bad.toml: key `rank`: 12 is not a rank vLLM allows"),
    "spec max-lora-rank is rank": spec_file("max-lora-rank = 12", "bad.toml: key `max-lora-rank`: 12 is not a rank vLLM allows"),
    "spec ranks": spec_file('rank = 16\nranks = "8:0.5,9:0.5"', "bad.toml: key `ranks`: rank 9 is not one vLLM allows"),
    "spec workload base twice": spec_file('workload = ["base:0.5+base:0.3"]', "bad.toml: key `workload`: workload"),
    "spec out empty": spec_file('out = ""', "bad.toml: key `out`: empty path"),
    "spec device": spec_file('device = "tpu"', "bad.toml: key `device`: 'tpu' is not one of"),
    "spec strategy auto without a run": spec_file('strategy = ["auto"]', "bad.toml: key `strategy` = auto needs --auto-from"),
    "spec budget without auto": spec_file("startup-budget = 5", "bad.toml: key `startup-budget`: --auto-from and the budgets"),
    "spec is a folder": Case(["sweep", "--out", "{results}", "--spec", "{tmp}"], "is a folder, not a TOML file"),
    "spec binary": spec_file(b"\xff\xfe\x00\x01", "not valid TOML"),
    "flag overrides a good spec, and is named": spec_file("concurrency = [1, 2]", "--concurrency: 0 must be at least 1",
                                                          "--concurrency", "0"),
    # -- check --------------------------------------------------------------------------------
    "check max-loras 0": check("--max-loras", "0", "--max-loras"),
    "check strategy auto": check("--strategy", "auto", "fixed capture sets"),
    "check seed past 2**32": check("--seed", "99999999999999999999", "--seed"),
    "check layers past the preset": check("--device", "cpu", "--layers", "3", "--layers: 3 is more than tiny's 2"),
    "check out is a file": check("--out", "{tmp}/afile", "afile is a file", files={"afile": "keep me"}),
    "check spec key": Case(["check", "--out", "{results}", "--spec", "{tmp}/bad.toml"], "bad.toml: key `rank`",
                           files={"bad.toml": "rank = 3"}),
    "check unknown kernels": check("--kernels", "cutlass", "--kernels"),
    # -- memory limits ------------------------------------------------------------------------
    "limit max_loras 100000 in 20 GiB": sweep("--max-loras", "100000", "max_loras 100000 does not fit: weights",
                                              free_gib=20),
    "limit max_loras 4096 in 1 GiB": sweep("--max-loras", "4,4096", "--strategy", "dense", "max_loras 4096 does not fit",
                                           free_gib=1),
    "limit names the memory it compares with": sweep("--max-loras", "8192", "GiB > 1.0 GiB available RAM", free_gib=1),
    "limit context_len": sweep("--context-len", "10000000", "context_len 10000000 at 8 token slots does not fit",
                               free_gib=20),
    "limit llama on the CPU": sweep("--model", "llama-2-7b", "--device", "cpu",
                                    "llama-2-7b (32 layers, float32) at 8 token slots does not fit", free_gib=20),
    "limit an MoE model names sharing its experts": sweep("--model", "qwen3-30b-a3b", "--device", "cpu",
                                                          "--share-expert-weights holds one set of experts", free_gib=20),
    "limit check too": check("--max-loras", "100000", "max_loras 100000 does not fit", free_gib=20),
    "limit from a spec file": spec_file("max-loras = [100000]", "max_loras 100000 does not fit", free_gib=20),
    "limit on this machine": sweep("--max-loras", "100000000", "max_loras 100000000 does not fit"),
    "limit dense on this machine": sweep("--max-loras", "1000000000", "--strategy", "dense",
                                         "max_loras 1000000000 does not fit"),
    "limit context on this machine": sweep("--context-len", "100000000000", "context_len 100000000000"),
    # -- report -------------------------------------------------------------------------------
    "report folder without points": Case(["report", "{tmp}/empty"], "no points.parquet", files={"empty/": 0o755}),
    "report results without runs": Case(["report", "--results", "{tmp}/empty"], "no runs", files={"empty/": 0o755}),
    "report missing folder": Case(["report", "{tmp}/missing"], "not a folder"),
    "report a run and a missing folder": Case(["report", "{run}", "{tmp}/missing"], "not a folder"),  # no report first
    "report corrupt parquet": Case(["report", "{tmp}/bad"], "cannot be read", files={"bad/points.parquet": b"not parquet"}),
    "report parquet of another schema": Case(["report", "{tmp}/other"], "is not a lorabench sweep's",
                                             files={"other/points.parquet": "other-schema"}),
    "report unknown flag": Case(["report", "{run}", "--bogus"], "bogus"),
    # -- adapters and residency ----------------------------------------------------------------
    "sweep adapters 0": sweep("--adapters", "0", "--adapters: 0 must be at least 1"),
    "sweep adapters not whole": sweep("--adapters", "2.5", "--adapters: '2.5' is not an integer"),
    "sweep cpu cache without adapters": sweep("--max-cpu-loras", "8", "--max-cpu-loras: goes with --adapters N"),
    "sweep load path without adapters": sweep("--load-path", "one-copy", "--load-path: goes with --adapters N"),
    "sweep unknown load path": sweep("--adapters", "10", "--load-path", "overlapped",
                                     "--load-path: 'overlapped' is not one of per-slice, one-copy"),
    "sweep output tokens without adapters": sweep("--output-tokens", "64", "--output-tokens: goes with --adapters N"),
    "sweep output tokens 0": sweep("--adapters", "10", "--output-tokens", "0", "--output-tokens: '0' needs 1 <= LO <= HI"),
    "sweep output tokens reversed": sweep("--adapters", "10", "--output-tokens", "900-300",
                                          "--output-tokens: '900-300' needs 1 <= LO <= HI"),
    "sweep output tokens not a range": sweep("--adapters", "10", "--output-tokens", "a-b",
                                             "--output-tokens: 'a-b' is neither a token count N nor a range LO-HI"),
    "sweep output tokens too many": sweep("--adapters", "10", "--output-tokens", "1-100001",
                                          "--output-tokens: '1-100001' is above 100000 tokens"),
    "sweep cpu cache below the slots": sweep("--adapters", "10", "--max-loras", "4,8", "--max-cpu-loras", "4",
                                             "--max-cpu-loras 4 is below --max-loras 8"),
    "sweep adapters with ranks": sweep("--adapters", "10", "--rank", "64", "--ranks", "8:0.5,64:0.5", "not with --ranks"),
    # --adapters DIR: PEFT folders (tests/peft_folders.py writes them in PEFT's layout)
    "sweep adapters neither count nor folder": sweep("--adapters", "{tmp}/none", "neither a count of adapters nor a folder"),
    "sweep adapters folder of none": sweep("--adapters", "{tmp}/empty", "holds no PEFT adapter",
                                           files={"empty/notes.txt": "x"}),
    "sweep adapters glob of none": sweep("--adapters", "{tmp}/empty/*", "matches no adapter folder",
                                         files={"empty/notes.txt": "x"}),
    "sweep adapters without weights": sweep("--adapters", "{tmp}/x", "no adapter_model.safetensors",
                                            files={"x/adapter_config.json": '{"r": 8, "lora_alpha": 8}'}),
    "sweep adapters pickled weights": sweep("--adapters", "{tmp}/x", "adapter_model.bin, a pickle, is not read",
                                            files={"x/adapter_config.json": '{"r": 8, "lora_alpha": 8}', "x/adapter_model.bin": b"\x80"}),
    "sweep adapters config not json": sweep("--adapters", "{tmp}/x", "adapter_config.json is not readable JSON",
                                            files={**adapter_files("x"), "x/adapter_config.json": "{r: 8"}),
    "sweep adapters corrupt safetensors": sweep("--adapters", "{tmp}/x", "not a readable safetensors file",
                                                files={**adapter_files("x"), "x/adapter_model.safetensors": b"garbage"}),
    "sweep adapters rank above --rank": sweep("--model", "tiny", "--rank", "16", "--adapters", "{tmp}/x", "has rank 32, above --rank 16",
                                              files=adapter_files("x", r=32)),
    "sweep adapters unknown target": sweep("--model", "tiny", "--adapters", "{tmp}/x", "which layer 0 of tiny (dense) has no LoRA linear",
                                           files=adapter_files("x", tensors=module_tensors(0, "mlp.gate", 8, 128, 4, RNG))),
    "sweep adapters other hidden size": sweep("--model", "tiny", "--adapters", "{tmp}/x", "needs A [r, 128] and B [128, r]",
                                              files=adapter_files("x", tensors=module_tensors(0, "self_attn.o_proj", 8, 128, 64, RNG))),
    "sweep adapters lone A": sweep("--adapters", "{tmp}/x", "has lora_A without lora_B",
                                   files=adapter_files("x", tensors={f"{PREFIX}.0.self_attn.k_proj.lora_A.weight": LONE_A})),
    "sweep adapters not a lora tensor": sweep("--adapters", "{tmp}/x", "is not a LoRA A or B of a decoder layer",
                                              files=adapter_files("x", tensors={"base_model.model.lm_head.weight": LONE_A})),
    "sweep adapters without lora_alpha": sweep("--adapters", "{tmp}/x", "no lora_alpha in adapter_config.json",
                                               files={**adapter_files("x"), "x/adapter_config.json": '{"r": 8}'}),
    "sweep adapters bare parameters": sweep("--adapters", "{tmp}/x", "vLLM serves LoRA on bare parameters only on a MoE",
                                            files=adapter_files("x", config={"target_parameters": ["mlp.gate.weight"]})),
    "sweep adapters dora": sweep("--adapters", "{tmp}/x", "use_dora is set", files=adapter_files("x", config={"use_dora": True})),
    "sweep adapters dir with ranks": sweep("--rank", "64", "--ranks", "8:1", "--adapters", "{tmp}/x",
                                           "--ranks: not with --adapters DIR", files=adapter_files("x")),
    "check adapters count": check("--adapters", "4", "lorabench check takes a folder of PEFT adapters"),
    "recommend adapters folder of none": Case(["recommend", "{run}", "--adapters", "{tmp}/empty"], "holds no PEFT adapter",
                                              files={"empty/notes.txt": "x"}),
    "sweep adapters over a steps trace": trace("concurrency,n_active\n1,1\n2,1\n4,1\n8,1\n", "not requests with adapters",
                                               command="sweep-adapters"),
    "sweep adapters fewer than the trace's": trace("adapter\na\nb\nc\nd\ne\nf\ng\nh\n", "has 8 adapters, more than --adapters 2",
                                                   command="sweep-adapters"),
    "spec adapters": spec_file("adapters = 0", "bad.toml: key `adapters`: 0 must be at least 1"),
    "recommend adapters 0": Case(["recommend", "{run}", "--adapters", "0"], "--adapters: 0 must be at least 1"),
    "recommend adapters with a graph budget": Case(["recommend", "{run}", "--adapters", "10", "--graph-memory-budget", "5"],
                                                   "--graph-memory-budget prices strategy auto alone; with --adapters use --gpu-memory-budget"),
    "recommend concurrency without adapters": Case(["recommend", "{run}", "--concurrency", "8"], "--concurrency: goes with --adapters N"),
    "recommend gpu budget without adapters": Case(["recommend", "{run}", "--gpu-memory-budget", "8"],
                                                  "--gpu-memory-budget: goes with --adapters N"),
    "recommend more clients than the run": Case(["recommend", "{run}", "--adapters", "10", "--concurrency", "64"],
                                                "64 clients need fixed points up to concurrency 64; the run has them up to 8"),
    "recommend negative gpu budget": Case(["recommend", "{run}", "--adapters", "10", "--gpu-memory-budget", "-1"],
                                          "--gpu-memory-budget: '-1' is not a positive number"),
    "recommend adapters over a steps trace": Case(["recommend", "{run}", "--adapters", "10", "--workload", "trace:{tmp}/t.csv"],
                                                  "not requests with adapters", files={"t.csv": "concurrency,n_active\n1,1\n"}),
    "recommend output tokens 0": Case(["recommend", "{run}", "--adapters", "10", "--output-tokens", "0"],
                                      "--output-tokens: '0' needs 1 <= LO <= HI"),
    # -- where the groups run -----------------------------------------------------------------
    "sweep executor nope": sweep("--executor", "nope", "--executor nope: choose local or dask"),
    "check executor nope": check("--executor", "nope", "--executor nope: choose local or dask"),
    "sweep gpus beyond the visible ones": sweep("--gpus", "7", "--gpus 7: this host has"),
    "sweep gpus not indices": sweep("--gpus", "first", "--gpus first: give GPU indices like 0,1, or all"),
    "sweep scheduler without dask": sweep("--scheduler", "tcp://127.0.0.1:9", "--scheduler goes with --executor dask"),
    "sweep scheduler with gpus": sweep("--executor", "dask", "--scheduler", "tcp://127.0.0.1:9", "--gpus", "0",
                                       "--gpus chooses this host's GPUs"),
    "sweep scheduler unreachable": sweep("--executor", "dask", "--scheduler", "tcp://127.0.0.1:9",
                                         "--scheduler tcp://127.0.0.1:9: cannot connect", skip=_dask_skip(True)),
    "sweep scheduler not an address": sweep("--executor", "dask", "--scheduler", "nowhere:x", "--scheduler nowhere:x: cannot connect",
                                            skip=_dask_skip(True)),
    "sweep dask not installed": sweep("--executor", "dask", "--executor dask needs dask.distributed: pip install 'lorabench[dask]'",
                                      skip=_dask_skip(False)),
    "resume executor nope": Case(["sweep", "--resume", "{run}", "--executor", "nope"], "--executor nope"),
    # -- recommend ----------------------------------------------------------------------------
    "recommend missing run": Case(["recommend", "{tmp}/missing"], "not a folder"),
    "recommend folder without points": Case(["recommend", "{tmp}/empty"], "no points.parquet", files={"empty/": 0o755}),
    "recommend bad workload": Case(["recommend", "{run}", "--workload", "zipf:-1"], "bad workload term"),
    "recommend workload base twice": Case(["recommend", "{run}", "--workload", "base:0.5+base:0.3"], "names base twice"),
    "recommend negative memory budget": Case(["recommend", "{run}", "--graph-memory-budget", "-5"], "--graph-memory-budget"),
    "recommend startup budget nan": Case(["recommend", "{run}", "--startup-budget", "nan"], "--startup-budget"),
    "recommend unknown kernels": Case(["recommend", "{run}", "--kernels", "cutlass"], "nothing to optimise"),
    "recommend max-loras not in the run": Case(["recommend", "{run}", "--max-loras", "7"], "nothing to optimise"),
    "recommend max-loras 0": Case(["recommend", "{run}", "--max-loras", "0"], "--max-loras: 0 must be at least 1"),
    "recommend without a run": Case(["recommend"], "Missing argument"),
    "recommend budget nothing fits": Case(["recommend", "{run}", "--graph-memory-budget", "0.001"],
                                          "no capture set fits the budgets"),
    # -- tune ---------------------------------------------------------------------------------
    "tune unknown kernels": Case(["tune", "--out", "{tmp}/tuned", "--kernels", "cutlass"], "--kernels"),
    "tune budget 0": Case(["tune", "--out", "{tmp}/tuned", "--budget-s", "0"], "--budget-s"),
    "tune tokens over 16384": Case(["tune", "--out", "{tmp}/tuned", "--tokens", "20000"], "--tokens"),
    "tune rank 12": Case(["tune", "--out", "{tmp}/tuned", "--rank", "12"], "--rank"),
    "tune dtype float8": Case(["tune", "--out", "{tmp}/tuned", "--dtype", "float8"], "--dtype"),
    "tune max-loras 0": Case(["tune", "--out", "{tmp}/tuned", "--max-loras", "0"], "--max-loras"),
    "tune unknown model": Case(["tune", "--out", "{tmp}/tuned", "--model", "gpt-5"], "--model"),
    "tune device tpu": Case(["tune", "--out", "{tmp}/tuned", "--device", "tpu"], "--device"),
    "tune seed negative": Case(["tune", "--out", "{tmp}/tuned", "--seed", "-1"], "--seed"),
    "tune out is a file": Case(["tune", "--out", "{tmp}/afile", "--kernels", "triton", "--tokens", "1", "--budget-s", "1"],
                               "--out", files={"afile": "keep me"}),
    "tune corrupt cache": Case(["tune", "--out", "{tmp}/tuned", "--kernels", "triton", "--tokens", "1", "--budget-s", "1"],
                               "cache.jsonl", files={"tuned/cache.jsonl": '{"x": 1}\nnot json\n'}),
}


def _write(tmp: Path, files: dict) -> None:
    for name, content in files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith("/"):  # a folder, with these permission bits
            path.mkdir(exist_ok=True)
            path.chmod(content)
        elif isinstance(content, Path):
            path.symlink_to(tmp / content)
        elif content == "other-schema":
            import pandas as pd

            pd.DataFrame({"a": [1, 2]}).to_parquet(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def snapshot(root: Path) -> dict[str, str]:
    """Every file's and folder's path under root, with each file's hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = "dir"
        for f in filenames:
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, root)
            out[rel] = "link" if os.path.islink(path) else hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


@pytest.fixture
def place(tmp_path, monkeypatch):
    """A working folder holding results/<RUN> (an earlier run: its rows, run.json, a report's
    recommendation.json); the command runs from there."""
    run = tmp_path / "results" / RUN
    run.mkdir(parents=True)
    shutil.copy(H200_CARD / "points.parquet", run / "points.parquet")
    (run / "run.json").write_text(json.dumps({"run_id": RUN, "status": "finished"}) + "\n")
    (run / "recommendation.json").write_text(json.dumps({"note": "an earlier report's"}) + "\n")
    monkeypatch.chdir(tmp_path)
    # Input taken for good would start workers and run a whole sweep: they fail at once instead.
    monkeypatch.setattr(sweep_module, "WORKER", "lorabench_test_input_was_accepted")
    return tmp_path


def fill(argv: list[str], tmp: Path) -> list[str]:
    return [a.replace("{results}", str(tmp / "results")).replace("{run}", str(tmp / "results" / RUN))
            .replace("{tmp}", str(tmp)) for a in argv]


def assert_one_error_line(code: int, err: str, needle: str) -> str:
    lines = err.splitlines()
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0][len("error: "):].strip(), err
    assert needle in lines[0], err
    return lines[0]


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_writes_nothing(name, place, capsys, monkeypatch):
    case = CASES[name]
    if case.skip:
        pytest.skip(case.skip)
    _write(place, case.files)
    if case.free_gib is not None:
        monkeypatch.setattr(env, "machine", lambda: Machine(cuda=False, free_ram_bytes=int(case.free_gib * GiB)))
    before = snapshot(place)
    code = main(fill(case.argv, place))
    out, err = capsys.readouterr()
    assert_one_error_line(code, err, case.needle)
    assert out == "", out  # no notice before the refusal: the one line is all
    assert snapshot(place) == before


def test_executor_dask_without_dask_installed(place, capsys, monkeypatch):
    for name in ("distributed", "dask"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as where neither is installed
    before = snapshot(place)
    code = main(fill(["sweep", "--out", "{results}", "--executor", "dask"], place))
    assert_one_error_line(code, capsys.readouterr().err, "--executor dask needs dask.distributed: pip install 'lorabench[dask]'")
    assert snapshot(place) == before


def test_out_that_cannot_be_made_when_the_run_folder_is_created(place, capsys, monkeypatch):
    """Past the spec's check (say the folder became unwritable in between): still one line."""
    (place / "afile").write_text("keep me")
    monkeypatch.setattr(spec_module, "check_out", lambda out, where: None)
    before = snapshot(place)
    code = main(["sweep", "--out", str(place / "afile"), "--max-loras", "2", "--concurrency", "1"])
    assert_one_error_line(code, capsys.readouterr().err, "--out")
    assert snapshot(place) == before


@pytest.mark.e2e
@pytest.mark.parametrize("argv,needle", [
    (["sweep", "--seed", "99999999999999999999"], "error: --seed: 99999999999999999999 must be at most 4294967295"),
    (["sweep", "--out", "/dev/null"], "error: --out: /dev/null is not a folder"),
    (["sweep", "--max-loras", "100000000"], "error: max_loras 100000000 does not fit: "),
    (["recommend", f"results/{RUN}", "--workload", "base:0.5+base:0.3"], "error: workload 'base:0.5+base:0.3' names base twice"),
    (["report", "missing"], "error: "),
], ids=["seed", "out-dev-null", "max-loras", "recommend", "report"])
def test_the_real_process_prints_one_line(place, argv, needle):
    """``python -m lorabench``: exit 2, one line, no traceback, nothing written."""
    before = snapshot(place)
    p = subprocess.run([sys.executable, "-m", "lorabench", *argv], capture_output=True, text=True, timeout=120, cwd=place)
    line = assert_one_error_line(p.returncode, p.stderr, needle)
    assert line.startswith(needle)
    assert snapshot(place) == before


# -- memory limits: the estimate behind them, against what the model really allocates ----------

@pytest.mark.parametrize("max_loras,max_tokens,context_len,dtype", [
    (4, 8, 64, "float32"), (64, 32, 256, "bfloat16"), (300, 1, 16, "float16"),
])
def test_memory_estimate_covers_the_real_model(max_loras, max_tokens, context_len, dtype):
    """The resident terms are LlamaLoRA's parameters and buffers to the byte; the whole
    estimate (the process's runtime aside) is above them and not wildly so."""
    import torch

    from lorabench.config.limits import RUNTIME, Shape, estimate, model_bytes
    from lorabench.config.models import resolve
    from lorabench.runtime.model import LlamaLoRA

    cfg = resolve("tiny")
    model = LlamaLoRA(cfg, max_loras=max_loras, rank=16, max_tokens=max_tokens, context_len=context_len,
                      dtype=getattr(torch, dtype), device="cpu")
    real = sum(t.nbytes for t in model.parameters()) + sum(t.nbytes for t in model.buffers())
    shape = Shape(cfg, max_loras, 16, dtype, max_tokens, context_len)
    assert sum(model_bytes(shape)) == real
    assert model_bytes(shape)[1] == max_loras * model.lora_bytes_per_slot()
    e = estimate(shape, graphs=10, cuda=False)
    assert real < e.total - RUNTIME < 2.5 * real
    assert e.graphs == 0 and "graphs" not in e.describe()  # eager steps on the CPU
    on_gpu = estimate(shape, graphs=10, cuda=True)
    assert on_gpu.graphs > 0 and on_gpu.total > e.total and "graphs ~" in on_gpu.describe()
    assert estimate(Shape(cfg, max_loras, 16, dtype, max_tokens, context_len, vllm=True), 10, False).adapters == 2 * e.adapters


@pytest.mark.parametrize("name", ["max", "pow2", "dense", "agnostic", "[1,3,8]"])
def test_graph_count_is_the_dispatchers(name):
    from lorabench.config.limits import graph_count
    from lorabench.config.strategies import strategy
    from lorabench.runtime.dispatch import LorabenchRules

    s, sizes = strategy(name), [1, 2, 4, 8, 16]
    rules = LorabenchRules(s.counts(8), 8, 16, "cpu", s.bucket_grid)
    assert graph_count(s.counts(8), 8, sizes, s.bucket_grid, vllm=False) == sum(len(rules.keys(b)) for b in sizes)


def test_the_machine_says_how_much_memory_is_free():
    m = env.machine()
    free, what = m.free_bytes("cpu")
    assert what == "available RAM" and (free is None or free > 0)
    if HAS_CUDA:
        assert m.free_gpu_bytes > 0 and m.free_bytes("cuda")[1].startswith("free GPU memory")


def test_unknown_free_memory_is_not_checked():
    from lorabench.config.spec import build_spec

    flags = {"max_loras": "100000", "device": "cpu", "strategy": "max"}
    spec, _ = build_spec(flags, None, Machine(cuda=False))
    assert spec.max_loras == [100000]
    with pytest.raises(UserError, match="max_loras 100000 does not fit"):
        build_spec(flags, None, Machine(cuda=False, free_ram_bytes=GiB))


@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen3-8b", "llama-3.1-70b"])
def test_memory_estimate_covers_real_configs_and_tp_ranks(name):
    """Biases, q/k norms and one TP rank's shapes are in the estimate to the byte (models cut to
    one layer and a small vocabulary, so the CPU can build them)."""
    from dataclasses import replace

    import torch

    from lorabench.config.limits import Shape, model_bytes
    from lorabench.config.models import resolve, shard
    from lorabench.runtime.model import LlamaLoRA

    full = replace(resolve(name, layers=1), vocab=1024, hidden=512, intermediate=1024)
    for tp in (1, 4):
        cfg = shard(full, tp)
        model = LlamaLoRA(cfg, max_loras=2, rank=8, max_tokens=2, context_len=8, dtype=torch.float16, device="cpu")
        real = sum(t.nbytes for t in model.parameters()) + sum(t.nbytes for t in model.buffers())
        assert sum(model_bytes(Shape(cfg, 2, 8, "float16", 2, 8))) == real
