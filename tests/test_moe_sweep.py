"""End to end on the CPU: a sweep of a tiny MoE model through real worker processes (torch kernels,
whose grid semantics are the Triton paths'), its MoE columns, and the check's verdict."""

import pandas as pd
import pytest

from lorabench.cli import main

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-moe-shared"])
def test_a_moe_sweep_checks_every_graph_and_records_the_expert_lora_path(tmp_path, model):
    code = main(["sweep", "--out", str(tmp_path), "--model", model, "--kernels", "torch", "--max-loras", "2",
                 "--concurrency", "1,33", "--strategy", "max,pow2", "--iters", "3", "--warmup", "1",
                 "--context-len", "16", "--workload", "uniform", "--device", "cpu"])
    assert code == 0
    df = pd.read_parquet(next(tmp_path.glob("*/points.parquet")))
    assert (df.status == "ok").all() and df.correct.all()
    assert (df.experts == {"tiny-moe": 16, "tiny-moe-shared": 6}[model]).all() and (df.top_k == 2).all()
    assert (df.expert_lora_bytes_per_slot > 0).all()
    assert (df.lora_bytes_per_slot > df.expert_lora_bytes_per_slot).all()  # attention LoRA too
    fixed = df["mode"] == "fixed"
    launched = df[~fixed | (df.n_active > 0)]
    paths = launched.groupby("concurrency").moe_lora_path.unique().to_dict()
    # 1 token: per-entry; 33 over at most 2 columns: sorted
    assert list(paths[1]) == ["per-entry"] and list(paths[33]) == ["sorted"]
    assert df[fixed & (df.n_active == 0)].moe_lora_path.isna().all()  # no adapter launched: no path
    if model == "tiny-moe-shared":
        return
    assert main(["report", str(next(tmp_path.glob("*/points.parquet")).parent)]) == 0
    report = next(tmp_path.glob("*/report.md")).read_text()
    section = report.split("## Expert LoRA's path")[1].split("\n## ")[0]
    assert "| 1 | 1 | per-entry |" in section and "| 33 | 33 | sorted |" in section
    assert "per-entry (specialisation moot for the experts) at c = 1" in section


def test_a_sweep_with_shared_expert_weights_records_them_and_passes_the_check(tmp_path):
    code = main(["sweep", "--out", str(tmp_path), "--model", "tiny-moe", "--share-expert-weights", "--kernels", "torch",
                 "--max-loras", "2", "--concurrency", "2", "--strategy", "max", "--iters", "2", "--warmup", "1",
                 "--context-len", "16", "--workload", "uniform", "--device", "cpu"])
    assert code == 0
    df = pd.read_parquet(next(tmp_path.glob("*/points.parquet")))
    assert (df.status == "ok").all() and df.correct.all() and (df.shared_expert_weights == True).all()  # noqa: E712
    run = next(tmp_path.glob("*/points.parquet")).parent
    assert main(["report", str(run)]) == 0
    assert "one set of routed-expert weights read by every MoE layer" in (run / "report.md").read_text()


def test_the_expert_lora_section_is_left_out_without_n_1_points_and_compares_only_against_max():
    import pandas as pd

    from lorabench.commands.report.moe import moe_md

    rows = [dict(kernels="triton", max_loras=4, strategy=s, concurrency=c, n_active=n, graph_tokens=c,
                 moe_lora_path="per-entry" if c == 1 else "sorted", step_ms_median=ms, base_ms=1.0)
            for s, c, n, ms in [("pow2", 1, 1, 1.5), ("dense", 1, 1, 1.4), ("pow2", 8, 1, 2.0), ("dense", 8, 1, 1.8)]]
    over = pd.DataFrame(rows)
    assert "no n = 1 point" in "\n".join(moe_md(over[over.concurrency > 1].assign(n_active=2), "GPU ms"))
    text = "\n".join(moe_md(over, "GPU ms"))  # no max: overheads only, no "vs max" column
    assert "| c | bucket | expert-LoRA path | dense overhead | pow2 overhead |" in text and "vs max" not in text
    assert "| 1 | 1 | per-entry | 0.400 | 0.500 |" in text and "at c = 1" in text


def test_the_expert_lora_section_names_each_sets_path_where_the_launch_count_changes_it():
    from lorabench.commands.report.moe import moe_md

    rows = [dict(kernels="triton", max_loras=16, strategy=s, concurrency=64, n_active=1, graph_tokens=64,
                 moe_lora_path=p, step_ms_median=ms, base_ms=1.0)
            for s, p, ms in [("max", "per-entry", 2.0), ("pow2", "sorted", 1.5)]]
    text = "\n".join(moe_md(pd.DataFrame(rows), "GPU ms"))
    assert "| 64 | 64 | max: per-entry; pow2: sorted | 1.000 | 0.500 | -25.0 % |" in text
    assert "moot" not in text  # specialising changed the experts' path: not moot
