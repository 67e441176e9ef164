"""Each option declared once (``lorabench.config.sweep_spec.SweepSpec``): its flag, its help, its
spec-file key and the checks of its value follow, and the options rows copy from their job are
columns of the row, of the same type. The next option is one declaration."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from lorabench.config.flags import Machine
from lorabench.config.options import Kind, option, options_of
from lorabench.config.plan import COPIED, Job, plan
from lorabench.config.spec import build_spec, read_spec_file
from lorabench.config.sweep_spec import FIELDS, MAX_TOKENS, OPTIONS, SweepSpec
from lorabench.errors import UserError
from lorabench.storage.schema import SCHEMA

ARROW_OF = {Kind.INT: "int64", Kind.NUMBER: "double", Kind.TEXT: "string", Kind.FLAG: "bool", Kind.INTS: "list<item: int64>"}


def test_every_option_is_a_spec_file_key_and_rank_has_vllms_name_too(tmp_path):
    assert FIELDS == set(OPTIONS) and "model_config" not in FIELDS and "auto_sets" not in FIELDS
    spec = tmp_path / "s.toml"
    spec.write_text("max-lora-rank = 32\nci_target = 1.5\nno_such = 1\n")
    with pytest.raises(UserError, match="unknown key 'no_such'"):
        read_spec_file(spec)
    spec.write_text("max-lora-rank = 32\nci_target = 1.5\n")
    assert read_spec_file(spec) == {"rank": ("max-lora-rank", 32), "ci_target": ("ci_target", 1.5)}


def test_a_flag_and_a_spec_file_give_the_same_value():
    for name, text, toml in [("concurrency", "1,2", [1, 2]), ("strategy", "max,[1,2]", ["max", [1, 2]]),
                             ("check", "false", False), ("seed", "7", 7), ("ci_target", "0.5", 0.5)]:
        assert OPTIONS[name].parse(text) == OPTIONS[name].parse(toml)


def test_bounds_come_from_the_declaration():
    assert OPTIONS["seed"].minimum == 0 and OPTIONS["warmup"].minimum == 0 and OPTIONS["iters"].minimum == 1
    with pytest.raises(UserError, match="^--iters: 0 must be at least 1$"):
        OPTIONS["iters"].parse("0")
    with pytest.raises(UserError, match="^--warmup: 100001 must be at most 100000$"):
        OPTIONS["warmup"].parse(100001)


def test_the_options_rows_copy_are_columns_of_their_type():
    copied = [o for o in OPTIONS.values() if o.column]
    assert {o.name for o in copied} >= {"tp", "rank", "seed", "iters", "warmup", "context_len", "ci_target", "adapters"}
    for o in copied:
        assert str(SCHEMA.field(o.name).type) == ARROW_OF[o.kind], o.name
        assert o.name in {f for f in Job.__dataclass_fields__}, o.name  # the worker copies it from the job


def test_a_job_gets_every_option_it_has_from_the_spec():
    spec, _ = build_spec({"device": "cpu", "concurrency": "1", "max_loras": "1", "strategy": "max", "iters": "7",
                          "seed": "3"}, None, Machine(cuda=False))
    [job] = plan(spec)
    assert set(COPIED) >= {"iters", "seed", "rank", "tp", "context_len", "warmup", "dtype"}
    assert all(getattr(job, name) == getattr(spec, name) for name in COPIED)


def test_the_next_option_is_one_declaration():
    """An option declared on a spec (say the upcoming --prefill-tokens) has its flag, its help with
    its default, its checks and its row column, with nothing else written for it."""

    @dataclass
    class WithPrefill(SweepSpec):
        prefill_tokens: int = option(0, "Prompt tokens prefilled before each decode step", minimum=0,
                                     maximum=MAX_TOKENS, column=True)

    o = options_of(WithPrefill)["prefill_tokens"]
    assert o.kind is Kind.INT and o.flags == ("--prefill-tokens",) and o.column
    assert o.describe() == "Prompt tokens prefilled before each decode step [default: 0]."
    assert o.parse("64") == 64
    with pytest.raises(UserError, match="^--prefill-tokens: 'x' is not an integer$"):
        o.parse("x")
    with pytest.raises(UserError, match="^--prefill-tokens: 513 must be at most 512$"):
        o.parse(513)
    assert WithPrefill().prefill_tokens == 0


def test_a_flag_on_by_default_is_turned_off_by_no():
    assert OPTIONS["check"].flags == ("--no-check",) and OPTIONS["fully_sharded_loras"].flags == ("--fully-sharded-loras",)
    assert OPTIONS["rank"].flags == ("--rank", "--max-lora-rank")


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "sweeps").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_shipped_sweep_spec_builds_on_an_h200(path):
    """The specs BENCHMARKS.md's commands name: each key known, each value valid, each model built,
    on a machine like the one they were written for (memory not checked: unknown)."""
    spec, _ = build_spec({}, path, Machine(cuda=True, gpu_name="NVIDIA H200"))
    assert spec.model_config is not None and spec.concurrency


def test_active_counts_keep_n_0_and_skip_counts_a_concurrency_cannot_reach(tmp_path):
    spec, _ = build_spec({"max_loras": [4], "concurrency": [1, 8], "strategy": ["max"], "active_counts": [4, 2],
                          "out": str(tmp_path), "device": "cpu"}, None, Machine(cuda=False))
    assert spec.active_counts == [0, 2, 4]
    (job,) = plan(spec)
    fixed = [(p.concurrency, p.n_active) for p in job.points if p.n_active is not None]
    assert fixed == [(1, 0), (8, 0), (8, 2), (8, 4)]
    every, _ = build_spec({"max_loras": [4], "concurrency": [1, 8], "strategy": ["max"], "out": str(tmp_path),
                           "device": "cpu"}, None, Machine(cuda=False))
    assert [(p.concurrency, p.n_active) for p in plan(every)[0].points if p.n_active is not None] == \
        [(1, 0), (1, 1)] + [(8, n) for n in range(5)]
