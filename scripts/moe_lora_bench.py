"""Expert LoRA alone, every MoE layer of a model, one CUDA graph per step, on the GPU. (GPU only.)

    python scripts/moe_lora_bench.py [--model qwen3-30b-a3b] [--max-loras 4]
                                     [--points 1:1,2:1,4:1,4:4,8:1,8:4,16:4,32:4,64:1,64:4] [--json OUT.json]
                                     [--expand-programs 512,2048] [--block-programs 64] [--base-tokens 1]
                                     [--with-gemm]

A point ``tokens:active:launch`` gives lorabench's kernels ``launch`` adapter columns (``max``'s
graphs launch max_loras) instead of the active count.

For each point (tokens : active adapters), one graph holds w13's and w2's expert LoRA of every MoE
layer (each layer its own A and B in vLLM's layout, its own random routing, rank 16, bf16), as a
decode step runs them, without the base MoE: the figure vLLM's issue tracker quotes for
``fused_moe_lora``. Variants, all in the same process and timed in alternating turns:
lorabench's per-entry path and sorted path (grid = the active count), each forced, the per-entry
path with an ordinary launch (``per-entry no pdl``; by default it is its predecessor's PDL
successor on sm90+, h computed while the expert GEMM runs, with ``--with-gemm``), and
lorabench's rule; vLLM 0.33's ``fused_moe_lora`` under its own path rule with its default grid
(max_loras + 1) and with ``--specialize-active-lora``'s. Each variant's output is checked against
the plain-torch reference on the first layer before it is timed. The sweep (``lorabench sweep``)
measures whole steps; this isolates the expert-LoRA kernels and the path threshold.

``--with-gemm``: every variant runs after the grouped GEMM that makes its y (w13's, then w2's, the
routing weights in), and two more join them: ``gemm alone`` (the GEMMs, no LoRA) and ``lorabench
in-gemm`` (the ``gemm`` backend's op, by its rule: the GEMM with the expert LoRA inside it, one
launch, ``per-tile``: each output tile computing its h, in the GEMM's K loop where its block holds
one slot's entries; ``two-pass``: after the K loop always; ``shrink-first``: the sorted shrink
before it, so that its output tiles read h instead). A
variant's cost of expert LoRA is then its time minus ``gemm alone``'s, the only fair comparison for
an op that has no GEMM-free form. The layers share one set of base weights (a whole model's would
not fit beside the adapters on one GPU); each has its own routing, LoRA and outputs.
"""

import argparse
import json
import random
from unittest import mock

import numpy as np
import torch

from lorabench.config.batches import fixed_batch, parse_bench_points
from lorabench.config.models import moe_layer, resolve
from lorabench.kernels import moe_lora_per_entry, reference
from lorabench.kernels.moe_align import align_blocks
from lorabench.kernels.moe_gemm import BLOCK_M, expert_gemm
from lorabench.kernels.moe_gemm_lora import IN_GEMM, IN_GEMM_SHRUNK, expert_gemm_lora
from lorabench.kernels.moe_gemm_lora import moe_path as gemm_path
from lorabench.kernels.expert_call import ExpertCall
from lorabench.kernels.moe_lora import PER_ENTRY, SORTED, SortedTiling, moe_lora_apply, moe_path
from lorabench.kernels.moe_lora_per_entry import PerEntryTiling
from lorabench.runtime.graphs import capture_graph
from lorabench.runtime.lora_meta import MetaBuffer
from lorabench.runtime.timing import replay_ms

RANK, REPLAYS, TOLERANCE = 16, 30, 5e-2  # bf16: relative error of the update against fp32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU (TRITON_INTERPRET=1): a smoke of the script only


def layer_calls(cfg, tokens: int, max_loras: int, gen) -> list[tuple[ExpertCall, ExpertCall]]:
    """(w13's call, w2's call) of every MoE layer, each layer's tensors its own."""
    dev, dt = torch.device(DEVICE), torch.bfloat16
    e, k, h, inter = cfg.moe.experts, cfg.moe.top_k, cfg.hidden, cfg.moe.intermediate

    def randn(*shape, std=1.0):
        return torch.randn(*shape, device=dev, dtype=dt, generator=gen) * std

    enabled = torch.ones(max_loras + 1, dtype=torch.int32, device=dev)
    x = randn(tokens, h)
    calls = []
    for i in range(cfg.layers):
        if not moe_layer(cfg, i):
            continue
        ids = torch.stack([torch.randperm(e, device=dev, generator=gen)[:k] for _ in range(tokens)])
        weights = torch.rand(tokens, k, device=dev, generator=gen)
        weights /= weights.sum(1, keepdim=True)
        layout = align_blocks(ids, e, BLOCK_M)
        w13 = ExpertCall(randn(tokens * k, 2 * inter), x, randn(2, max_loras, e, RANK, h, std=h**-0.5),
                         randn(2, max_loras, e, inter, RANK, std=RANK**-0.5), ids, weights, False, layout, enabled)
        w2 = ExpertCall(randn(tokens * k, h), randn(tokens * k, inter), randn(1, max_loras, e, RANK, inter, std=inter**-0.5),
                        randn(1, max_loras, e, h, RANK, std=RANK**-0.5), ids, weights, True, layout, enabled)
        calls.append((w13, w2))
    return calls


def ordinary_launch(apply):
    """``apply`` with the per-entry path launched as an ordinary kernel, not as the expert GEMM's
    PDL successor (``moe_lora_per_entry.PER_ENTRY_PDL``), as graphs captured under it keep it."""
    return mock.patch.object(moe_lora_per_entry, "PER_ENTRY_PDL", False)(apply)


def variants(cfg, tokens: int, max_loras: int, slots: list[int], tilings: list[SortedTiling] = (),
             launch: int | None = None, per_entry: list[PerEntryTiling] = ()) -> dict:
    """({name: (apply(call), the path it runs)}, the batch's LoRAMeta the reference reads);
    ``tilings``: the sorted path again under each (``SortedTiling``); ``per_entry``: the per-entry
    path again under each (``PerEntryTiling``); ``launch``: lorabench's adapter columns (None: the
    active count, as pow2's graphs at a power of two; max_loras: as max's graphs)."""
    buf = MetaBuffer(tokens, max_loras, torch.device(DEVICE))
    packed, n = buf.pack(slots)
    buf.load(packed)
    n = launch or n
    e, k = cfg.moe.experts, cfg.moe.top_k
    out = {
        "lorabench": (lambda c: moe_lora_apply(c, buf.meta, n, 1.0), moe_path(tokens, k, e, max_loras, n)),
        "lorabench per-entry": (lambda c: moe_lora_apply(c, buf.meta, n, 1.0, PER_ENTRY), PER_ENTRY),
        "lorabench sorted": (lambda c: moe_lora_apply(c, buf.meta, n, 1.0, SORTED), SORTED),
        "lorabench per-entry no pdl": (ordinary_launch(lambda c: moe_lora_apply(c, buf.meta, n, 1.0, PER_ENTRY)), PER_ENTRY),
    }
    for t in tilings:
        name = "lorabench sorted" + (f" x{t.expand_programs}" if t.expand_programs else " per-tile") + (
            f" b{t.block_programs}" if t.block_programs else "")
        out[name] = (lambda c, t=t: moe_lora_apply(c, buf.meta, n, 1.0, SORTED, t), SORTED)
    for t in per_entry:
        name = f"lorabench per-entry a{t.a_elements} w{t.num_warps}" + (f" p{t.programs}" if t.programs else "")
        out[name] = (
            lambda c, t=t: moe_lora_apply(c, buf.meta, n, 1.0, PER_ENTRY, per_entry=t), PER_ENTRY)
    try:
        from lorabench.kernels import vllm_moe_lora
        from lorabench.kernels.vllm_lora import VllmMeta, load_ops

        kernel_meta = load_ops()[2].make(max_loras, tokens, torch.device(DEVICE))
        kernel_meta.prepare_tensors(torch.tensor(slots, dtype=torch.int32, device=DEVICE))
        vpath = vllm_moe_lora.moe_path(tokens, k, e, max_loras, max_loras + 1)
        for name, specialize in (("vllm", False), ("vllm --specialize-active-lora", True)):
            meta = VllmMeta(kernel_meta, specialize)
            out[name] = (lambda c, m=meta: vllm_moe_lora.moe_lora_apply(c, m, max_loras + 1, 1.0, load_ops), vpath)
    except ImportError as err:
        print(f"vLLM's kernels not measured: {err}")
    return out, buf.meta


def check(apply, calls, meta) -> float:
    """Relative error of the first layer's updates against the reference."""
    worst = 0.0
    for call in calls[0]:
        before = call.y.clone()
        want = call._replace(y=before.float())
        reference.moe_lora_apply(want, meta, 1, 1.0)
        apply(call)
        got = call.y.float() - before.float()
        ref = want.y - before.float()
        worst = max(worst, ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item())
        call.y.copy_(before)
    return worst


def base_weights(cfg, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, hidden] and w2 [E, hidden, I], bf16, shared by every layer (``--with-gemm``)."""
    e, h, inter = cfg.moe.experts, cfg.hidden, cfg.moe.intermediate
    w13 = torch.randn(e, 2 * inter, h, device=DEVICE, generator=gen) * h**-0.5
    return w13.to(torch.bfloat16), (torch.randn(e, h, inter, device=DEVICE, generator=gen) * inter**-0.5).to(torch.bfloat16)


def with_gemm(chosen: dict, weights: tuple[torch.Tensor, torch.Tensor], meta, launch: int, rule: str) -> dict:
    """Each variant as ``project(call) -> y``: the grouped GEMM of the call's projection, then the
    variant's update of its output; and ``gemm alone`` and the expert LoRA inside the GEMM, by the
    gemm backend's rule (its path ``rule``) and with h per tile and shrunk first."""
    def gemm(call):
        w = weights[call.mul_weight]
        return expert_gemm(call.x, w, call.topk_ids, call.layout, routed=call.topk_weights if call.mul_weight else None,
                           x_per_entry=call.x_per_entry)

    def then(apply):
        def project(call):
            y = gemm(call)
            apply(call._replace(y=y))
            return y
        return project

    out = {"gemm alone": (gemm, "-")}
    out.update({name: (then(apply), path) for name, (apply, path) in chosen.items()})
    for name, shrink_first, one_pass, path in (
            ("lorabench in-gemm", None, True, rule), ("lorabench in-gemm per-tile", False, True, IN_GEMM),
            ("lorabench in-gemm two-pass", False, False, IN_GEMM), ("lorabench in-gemm shrink-first", True, True, IN_GEMM_SHRUNK)):
        out[name] = (lambda c, f=shrink_first, o=one_pass: expert_gemm_lora(weights[c.mul_weight], c, meta, launch, 1.0,
                                                                            f, o), path)
    return out


def check_projection(project, gemm, calls, meta) -> float:
    """``check`` for ``with_gemm``'s variants: the first layer's outputs less the GEMM's against the
    reference's update (0 for ``gemm alone``)."""
    worst = 0.0
    for call in calls[0]:
        base = gemm(call)
        want = call._replace(y=base.float())
        reference.moe_lora_apply(want, meta, 1, 1.0)
        ref = want.y - base.float()
        got = project(call).float() - base.float()
        if project is not gemm:
            worst = max(worst, ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--points", default="1:1,2:1,4:1,4:4,8:1,8:4,16:4,32:4,64:1,64:4")
    ap.add_argument("--json", default=None)
    ap.add_argument("--base-tokens", type=int, default=0,
                    help="this many of each point's tokens use no adapter (slot -1): vLLM's active_lora_ids then "
                         "start with -1, which --specialize-active-lora's grid may cut an adapter for")
    ap.add_argument("--expand-programs", default="",
                    help="comma-separated: the sorted path also with its expand grouped to about this many programs "
                         "per adapter column (variant 'sorted xN'; 'sorted' is the default grouping, 'sorted per-tile' "
                         "one program per output tile)")
    ap.add_argument("--block-programs", default="",
                    help="comma-separated: the sorted path also with this many programs walking the expert blocks "
                         "that hold entries (variant 'sorted bN'); with --expand-programs, every pair too")
    ap.add_argument("--per-entry", default="",
                    help="comma-separated A_ELEMENTS:WARPS[:PROGRAMS]: the per-entry path also with its K loop in steps "
                         "of A_ELEMENTS elements of A, WARPS warps a program, and each entry's output tiles split over "
                         "programs until the grid holds about PROGRAMS (variant 'per-entry aA wW [pP]')")
    ap.add_argument("--with-gemm", action="store_true",
                    help="each variant after the grouped GEMM that makes its y, beside 'gemm alone' and 'lorabench "
                         "in-gemm' (the expert LoRA inside the GEMM)")
    args = ap.parse_args()
    per_entry = []
    for item in filter(None, args.per_entry.split(",")):
        try:
            a_elements, warps, *programs = (int(v) for v in item.split(":"))
        except ValueError:
            ap.error(f"--per-entry {item!r}: A_ELEMENTS:WARPS[:PROGRAMS], whole numbers")
        if a_elements < 16 or warps not in (1, 2, 4, 8, 16) or len(programs) > 1 or any(p < 1 for p in programs):
            ap.error(f"--per-entry {item!r}: A_ELEMENTS at least 16, WARPS 1, 2, 4, 8 or 16, PROGRAMS at least 1")
        per_entry.append(PerEntryTiling(a_elements, warps, programs[0] if programs else None))
    if args.base_tokens < 0:
        ap.error(f"--base-tokens {args.base_tokens}: a count of tokens, 0 or more")
    counts = {}
    for flag in ("expand_programs", "block_programs"):
        text = getattr(args, flag)
        try:
            counts[flag] = [int(v) for v in text.split(",") if v]
        except ValueError:
            ap.error(f"--{flag.replace('_', '-')} {text!r}: comma-separated program counts")
        if any(v < 1 for v in counts[flag]):
            ap.error(f"--{flag.replace('_', '-')} {text!r}: each count at least 1")
    default = SortedTiling()  # "lorabench sorted"; one expand program per output tile ("per-tile") always beside it
    tilings = [t for t in dict.fromkeys(SortedTiling(e, b) for e in [None, default.expand_programs, *counts["expand_programs"]]
                                        for b in [None, *counts["block_programs"]]) if t != default]
    cfg = resolve(args.model)
    if cfg.moe is None:
        ap.error(f"{args.model} is not a mixture-of-experts model")
    try:
        points = parse_bench_points(args.points, args.max_loras, args.base_tokens)
    except ValueError as err:
        ap.error(str(err))
    print(f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU: no timings'}, {cfg.name}: expert LoRA of every MoE layer (w13 + w2, rank {RANK}, bf16), "
          f"max_loras {args.max_loras}; ms per step, median of {REPLAYS} graph replays [p10, p90]")
    weights = base_weights(cfg, torch.Generator(device=DEVICE).manual_seed(0)) if args.with_gemm else None
    rows = []
    for tokens, active, launch in points:
        gen = torch.Generator(device=DEVICE).manual_seed(tokens * 100 + active)
        calls = layer_calls(cfg, tokens, args.max_loras, gen)
        slots = fixed_batch(tokens, active, args.max_loras, random.Random(tokens), args.base_tokens)
        chosen, meta = variants(cfg, tokens, args.max_loras, slots, tilings, launch, per_entry)
        if args.with_gemm:
            rule = gemm_path(tokens, cfg.moe.top_k, cfg.moe.experts, args.max_loras, launch or active)
            chosen = with_gemm(chosen, weights, meta, launch or active, rule)
            gemm = chosen["gemm alone"][0]
            errs = {name: check_projection(apply, gemm, calls, meta) for name, (apply, _) in chosen.items()}
        else:
            errs = {name: check(apply, calls, meta) for name, (apply, _) in chosen.items()}  # before any capture's
        graphs = {}  # warm-up adds its update to y, which would then grow from one variant's check to the next
        for name, (apply, path) in chosen.items():
            err = errs[name]

            def step(apply=apply):
                for w13, w2 in calls:
                    apply(w13)
                    apply(w2)

            graphs[name] = (capture_graph(step) if DEVICE == "cuda" else step, path, err)
        times = {name: [] for name in graphs}
        for _ in range(REPLAYS if DEVICE == "cuda" else 1):
            for name, (g, _, _) in graphs.items():
                times[name].append(replay_ms(g) if DEVICE == "cuda" else float("nan"))
        for name, (_, path, err) in graphs.items():
            t = np.array(times[name])
            row = {"model": cfg.name, "max_loras": args.max_loras, "tokens": tokens, "active": active, "launch": launch or active,
                   "base_tokens": args.base_tokens, "variant": name,
                   "path": path, "ms": float(np.median(t)), "p10": float(np.percentile(t, 10)),
                   "p90": float(np.percentile(t, 90)), "rel_err": err, "correct": err < TOLERANCE, "samples": t.tolist()}
            rows.append(row)
            flag = "" if row["correct"] else "  WRONG"
            print(f"c={tokens:<3d} n={active:<3d} g={launch or active:<3d} {name:30s} {path:9s} {row['ms']:7.3f} [{row['p10']:.3f}, {row['p90']:.3f}]"
                  f"  err {err:.1e}{flag}")
        del calls, graphs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
