"""The whole LoRA configuration under N adapters: max_loras from adapter residency, the capture
set, and what it costs in memory and KV cache (``lorabench recommend RUN --adapters N``, and the
report's residency section).

For a workload over N adapters driven by C clients, the closed loop is simulated for ``STEPS``
steps at each max_loras (``lorabench.analysis.occupancy``), and a run's points price every
(kernels, max_loras, capture set) the run measured, and the cost model's own best set
(``lorabench.analysis.residency_price``).

The choice (``ResidencyDecision``): per max_loras the fastest measured set, kept over max only if
the 95 % interval of its throughput gain clears ``PAYS`` (else max, the fewest graphs), and the
cost model's own best set only if it clears ``PAYS`` over that choice too (measured beats
modelled); then, among max_loras that fit the GPU memory budget, the one with the most tokens
per second, or the smallest max_loras whose shortfall from it is not shown to exceed ``PAYS``
(more slots cost KV cache). Different max_loras ran in different workers, so their comparisons
carry ``APART_MARGIN_PCT``. vLLM's kernels run vLLM's own dispatch rules, which this cost model
does not price: they are left out.
"""

from lorabench.analysis import search
from lorabench.analysis.cpu_cache import CachePolicy, choose_cpu_cache
from lorabench.analysis.decision import PAYS_PCT, CacheChoice, ResidencyDecision, SetChoice
from lorabench.analysis.occupancy import STEPS, simulated
from lorabench.analysis.points import not_found_wrong
from lorabench.analysis.residency_price import AUTO_SET, Pricer, path_prices, throughput_gain
from lorabench.analysis.view import RunView
from lorabench.analysis.vllm import UNVERIFIED_POW2, VllmAdvice, run_flags, verified_pow2
from lorabench.config.backends import backend_of
from lorabench.config.residency import Adapters
from lorabench.config.strategies import BASELINE, STRATEGIES, strategy
from lorabench.config.workload import parse_workload

CARD = 4  # the card's max_loras (sweeps/card.toml): what a recommendation is compared with


def set_at(view: RunView, pricer: Pricer, measured: dict[str, list[int]], memory_bytes: float | None) -> SetChoice:
    """The capture set at one max_loras (see ``SetChoice``). ``measured``: each measured fixed
    strategy's set; ``memory_bytes``: what the graphs may take."""
    sets = dict(measured)
    try:
        best = search.best(pricer.pricing, memory_bytes)
    except ValueError:
        best = None
    if best is not None and best.counts not in sets.values():
        sets[AUTO_SET] = best.counts
    priced = {name: p for name, c in sets.items() if (p := pricer.price(name, c)) is not None}
    if BASELINE not in priced:
        why = pricer.unpriced(sets.get(BASELINE, [pricer.L]))
        return SetChoice(pricer.L, priced=priced, unavailable=f"max cannot be priced: {why}")
    fits = {n: p for n, p in priced.items() if memory_bytes is None or (p.graph_mem_bytes or 0) <= memory_bytes + 1}
    base = priced[BASELINE]
    known = [p for n, p in fits.items() if n != AUTO_SET]
    fastest = min(known, key=lambda p: p.step_ms) if known else base
    fastest_gain = throughput_gain(view, (pricer, fastest), (pricer, base)) if fastest is not base else None
    chosen = fastest if fastest_gain is not None and fastest_gain.clears(PAYS_PCT) else base
    model, model_gain = fits.get(AUTO_SET), None
    if model is not None and model.step_ms < chosen.step_ms:
        model_gain = throughput_gain(view, (pricer, model), (pricer, chosen))
        chosen = model if model_gain.clears(PAYS_PCT) else chosen
    else:
        model = None
    gain = (None if chosen is base else fastest_gain if chosen is fastest
            else throughput_gain(view, (pricer, chosen), (pricer, base)))
    return SetChoice(pricer.L, chosen, priced, None if fastest is base else fastest, fastest_gain, model, model_gain,
                     gain)


def residency_decisions(view: RunView, workload: str, adapters: Adapters, clients: int | None = None,
                        gpu_memory_bytes: float | None = None, kernels: list[str] | None = None,
                        max_loras: list[int] | None = None, steps: int = STEPS, source: str | None = None,
                        cache: CachePolicy | None = None) -> list[ResidencyDecision]:
    """Per lorabench kernels label of the run: every (max_loras, capture set) priced under the
    workload over ``adapters``, driven by ``clients`` clients (default: the run's largest
    concurrency), and the chosen configuration (see the module's docstring). ``source``: the
    folder of the user's adapters (the validating sweep reads them); ``cache``: choose the CPU
    cache for the chosen configuration (``lorabench.analysis.cpu_cache``) when ``adapters``
    leaves it open."""
    ok = not_found_wrong(view.compared)
    fixed = ok[ok["mode"] == "fixed"]
    out = []
    for k, g in fixed.groupby("kernels"):
        if (kernels and k not in kernels) or backend_of(k) == "vllm":
            continue
        top = int(g.concurrency.max())
        c = clients or top
        if c > top:
            raise ValueError(f"{c} clients need fixed points up to concurrency {c}; the run has them up to {top}")
        at: dict[int, SetChoice] = {}
        pricers: dict[int, Pricer] = {}
        for m in sorted(int(x) for x in g.max_loras.unique()):
            if max_loras and m not in max_loras:
                continue
            if m > adapters.cpu_slots:
                at[m] = SetChoice(m, unavailable=f"above --max-cpu-loras {adapters.cpu_slots} "
                                  "(vLLM's CPU cache holds at least the GPU's slots)")
                continue
            sizes = [int(b) for b in g[g.max_loras == m].capture_sizes.iloc[0]]
            pricers[m] = p = Pricer(view, k, m, simulated(workload, adapters, c, m, sizes, steps))
            graph_budget = None if gpu_memory_bytes is None else gpu_memory_bytes - p.slot_bytes
            if graph_budget is not None and graph_budget < 0:
                at[m] = SetChoice(m, unavailable=f"its {m} adapter slots alone take more than the budget")
                continue
            measured = {s: list(counts) for s, (counts, correct) in view.measured_sets(k, m).items()
                        if s in STRATEGIES and STRATEGIES[s].fixed and correct is not False}
            at[m] = set_at(view, p, measured, graph_budget)
        decision = ResidencyDecision(k, parse_workload(workload).name, adapters, c, gpu_memory_bytes, at)
        d = _choose(view, decision, pricers)
        choice = None
        if cache is not None and adapters.max_cpu_loras is None and d.chosen is not None:
            choice = choose_cpu_cache(view, d.chosen, adapters, workload, c, cache, steps)
        out.append(_advise(view, d, ok.iloc[0], source, choice))
    return out


def _choose(view: RunView, d: ResidencyDecision, pricers: dict[int, Pricer]) -> ResidencyDecision:
    """Across max_loras: the most tokens per second, or the smallest max_loras not shown to
    fall more than PAYS short of it (its interval's low end below PAYS)."""
    budget = d.gpu_memory_bytes
    chosen = {m: at.chosen for m, at in d.at.items() if at.chosen is not None}
    chosen = {m: p for m, p in chosen.items() if budget is None or p.gpu_bytes is None or p.gpu_bytes <= budget + 1}
    if not chosen:
        return d
    best = max(chosen.values(), key=lambda p: p.tokens_per_s)
    pick, fewer = best, None
    for m in sorted(chosen):
        if m >= best.max_loras:
            break
        gain = throughput_gain(view, (pricers[best.max_loras], best), (pricers[m], chosen[m]))
        if not gain.clears(PAYS_PCT):
            pick, fewer = chosen[m], gain
            break
    card = (d.at.get(CARD) or SetChoice(CARD)).priced.get(BASELINE)
    card_gain = None
    if card is not None and (pick.max_loras, pick.counts) != (CARD, card.counts):
        card_gain = throughput_gain(view, (pricers[pick.max_loras], pick), (pricers[CARD], card))
    else:
        card = None
    return ResidencyDecision(d.kernels, d.workload, d.adapters, d.clients, budget, d.at, pick, best, fewer, card,
                             card_gain)


def _advise(view: RunView, d: ResidencyDecision, first, source: str | None = None,
            cache: CacheChoice | None = None) -> ResidencyDecision:
    """The vLLM flags, what the prices leave out, and the sweep that validates the choice
    (``first``: the first ok row of the configurations that passed their check; ``source``:
    the user's adapters' folder; ``cache``: the CPU cache chosen, if it was)."""
    c = d.chosen
    if c is None:
        return d
    cpu = cache.chosen.size if cache is not None and cache.chosen is not None else d.adapters.cpu_slots
    notes = []
    if c.occ.cpu_misses > 0:
        missed = f"{1000 * c.occ.cpu_misses:.1f} loads per 1000 steps miss the CPU cache of {d.adapters.cpu_slots}: "
        if c.miss is not None:
            fs = first.get("storage_fs")
            where = (f" (its files are on {fs}: memory, so no read was cold; a disk's would cost more)"
                     if fs in ("tmpfs", "ramfs") else f" (on {fs})" if isinstance(fs, str) else "")
            how = (f"its file's bytes at the run's cold read rate, {c.miss.fixed_ms:.1f} ms + "
                   f"{c.miss.bytes_per_ms / 1e6:.2f} GB/s: "
                   f"{c.miss_ms_per_step / c.occ.cpu_misses:.2f} ms per miss" if c.occ.miss_bytes is not None and
                   c.miss.bytes_per_ms else f"the run's cold read of an adapter's file, {c.miss.read_ms:.2f} ms")
            notes.append(f"{missed}each pays {how}{where}")
        else:
            notes.append(f"{missed}their reads from storage are not priced (the run read no adapter files: sweep "
                         "with --adapters DIR), so the expected step is a lower bound")
    m = c.max_loras
    pow2 = strategy("pow2").counts(m)
    specialise = c.counts == pow2 and c.counts != [m]
    flags = run_flags(first, m, specialise) + f" --max-cpu-loras {max(cpu, m)}"
    note = "vLLM captures max_loras+1 (and powers of two with --specialize-active-lora)"
    if c.counts not in ([m], pow2):
        note += f"; the set {c.counts} is lorabench's own, so the flags give vLLM's default"
    if specialise and not verified_pow2(view.verdicts):
        note += "; " + UNVERIFIED_POW2
    slots = sorted({m} | ({CARD} & set(d.at) if CARD <= d.adapters.cpu_slots else set()))
    strategies = sorted({c.set_name, BASELINE})
    sizes = sorted({int(b) for b in first.capture_sizes if int(b) <= d.clients} | {d.clients})
    validate = (f"lorabench sweep --max-loras {','.join(map(str, slots))} --strategy '{','.join(strategies)}' "
                f"--concurrency {','.join(map(str, sizes))} --kernels {d.kernels} "
                f"--workload {d.workload} --adapters {source or d.adapters.count} "
                f"--max-cpu-loras {cpu} --output-tokens {d.adapters.output_tokens} "
                f"--model {first.model} --rank {int(first['rank'])} --iters 1000 --ci-target 0.5")
    return ResidencyDecision(d.kernels, d.workload, d.adapters, d.clients, d.gpu_memory_bytes, d.at, c, d.best,
                             d.fewer, d.card, d.card_gain, tuple(notes), VllmAdvice(flags, note), validate,
                             load_paths=tuple(path_prices(view, c)), cpu_cache=cache)
