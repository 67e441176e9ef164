"""A model step that mixes decode tokens and prefill chunks (``forward(..., layout=)``): a prompt
in one chunk or two gives the same logits, a decode after a prefill equals the longer prefill's
last token, and requests sharing a step (base-model and adapter ones) do not see each other."""

import copy

import pytest
import torch
from conftest import DEVICE
from lorabench.kernels import get_backend

from lorabench.config.chunked import Piece, Step
from lorabench.config.models import ModelConfig
from lorabench.runtime.lora_meta import MetaBuffer
from lorabench.runtime.mixed_attention import MixedLayout
from lorabench.runtime.model import LlamaLoRA, LoRAStep
from lorabench.runtime.piecewise_graphs import PiecewiseStep

CFG = ModelConfig("m", 2, 128, 4, 2, 256, 97)
TOL = dict(rtol=1e-4, atol=1e-4)


def model(qk_norm=False):
    cfg = CFG if not qk_norm else ModelConfig("q", 2, 128, 4, 2, 256, 97, head_dim=32, qk_norm=True)
    return LlamaLoRA(cfg, max_loras=3, rank=8, max_tokens=16, context_len=32, dtype=torch.float32, device=DEVICE)


def run(m, pieces, ids, adapters, kernels="torch"):
    """One step of ``pieces`` ((request, tokens, context), cache row = request) over token ids ``ids``;
    request r takes adapter ``adapters[r]`` (-1: the base model)."""
    step = Step(tuple(Piece(r, adapters[r], n, c, True, True) for r, n, c in pieces))
    layout = MixedLayout.of(step, {r: r for r, _, _ in pieces})
    slots = [adapters[r] for r, n, _ in pieces for _ in range(n)]
    buf = MetaBuffer(len(slots), 3, DEVICE)
    buf.load(buf.pack(slots)[0])
    lora = LoRAStep(get_backend(kernels), buf.meta, 3, 0.5)
    return m(torch.tensor(ids, device=DEVICE), None, lora, layout)


PROMPT = [5, 17, 3, 88, 42, 9, 61, 30]


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("adapter", [-1, 1])
def test_a_prompt_in_one_chunk_or_two_gives_the_same_logits(qk_norm, adapter):
    whole, chunked = model(qk_norm), model(qk_norm)
    one = run(whole, [(0, 7, 0)], PROMPT[:7], {0: adapter})
    run(chunked, [(0, 4, 0)], PROMPT[:4], {0: adapter})
    two = run(chunked, [(0, 3, 4)], PROMPT[4:7], {0: adapter})
    torch.testing.assert_close(two, one[4:], **TOL)


@pytest.mark.parametrize("adapter", [-1, 2])
def test_a_decode_after_a_prefill_is_the_longer_prefills_last_token(adapter):
    whole, stepped = model(), model()
    one = run(whole, [(0, 8, 0)], PROMPT, {0: adapter})
    run(stepped, [(0, 7, 0)], PROMPT[:7], {0: adapter})
    decode = run(stepped, [(0, 1, 7)], PROMPT[7:], {0: adapter})
    torch.testing.assert_close(decode[0], one[7], **TOL)


@pytest.mark.parametrize("kernels", ["triton", "fused"])
@pytest.mark.parametrize("adapters", [{0: 1, 1: -1, 2: 2, 3: 0}, {0: 1, 1: -1, 2: 2, 3: -1}], ids=["n-3", "n-2"])
def test_prompts_longer_than_a_token_tile_take_their_adapters_in_lorabenchs_kernels(kernels, adapters):
    """A 70-token step (prompts of 37 and 29 tokens with adapters beside base and one-token
    pieces: two token tiles of 64) runs lorabench's kernels on their packed token tiles, launched
    for all 3 slots (n = 3, and n = 2 with a slot launched for nothing): the torch backend's logits.
    On a GPU the kernels' float32 dots are TF32 (about 1e-3 relative): the tolerance loosens there,
    and every adapter token's LoRA update stays 50x above it, so a token served no LoRA still fails."""
    big = lambda: LlamaLoRA(CFG, max_loras=3, rank=8, max_tokens=80, context_len=80, dtype=torch.float32,  # noqa: E731
                            device=DEVICE)
    ours, theirs, base = big(), big(), big()
    theirs.load_state_dict(ours.state_dict())
    base.load_state_dict(ours.state_dict())
    pieces, ids = [(0, 37, 0), (1, 3, 0), (2, 29, 0), (3, 1, 0)], [(7 * i) % 97 for i in range(70)]
    want = run(theirs, pieces, ids, adapters)
    tol = dict(rtol=2e-2, atol=2e-2) if DEVICE == "cuda" else TOL
    torch.testing.assert_close(run(ours, pieces, ids, adapters, kernels), want, **tol)
    update = (want - run(base, pieces, ids, dict.fromkeys(adapters, -1))).abs().amax(dim=1)
    takes = torch.tensor([adapters[r] >= 0 for r, n, _ in pieces for _ in range(n)], device=update.device)
    assert update[takes].min() > 50 * tol["atol"] and update[~takes].max() == 0


def test_requests_sharing_a_mixed_step_do_not_see_each_other():
    """A decode with context, a chunk with context, a new prompt and a base-model decode in one
    step give each the logits they get alone."""
    m = model()
    for r in range(4):  # some context for each request's row
        run(m, [(r, 6, 0)], PROMPT[:6], {r: [0, 1, -1, 2][r]})
    adapters = {0: 0, 1: 1, 2: -1, 3: 2}
    pieces = [(0, 1, 6), (2, 1, 6), (1, 3, 6), (3, 4, 0)]
    ids = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    together = run(copy.deepcopy(m), pieces, ids, adapters)
    start = 0
    for r, n, c in pieces:
        alone = run(copy.deepcopy(m), [(r, n, c)], ids[start:start + n], adapters)
        torch.testing.assert_close(together[start:start + n], alone, **TOL)
        start += n
    base = run(copy.deepcopy(m), pieces, ids, {r: -1 for r in adapters})
    assert (together[:1] - base[:1]).abs().max() > 1e-3  # the adapters changed their requests' logits


def test_a_layout_for_other_tokens_gets_one_line():
    m = model()
    layout = MixedLayout.of(Step((Piece(0, -1, 3, 0, True, True),)), {0: 0})
    with pytest.raises(ValueError, match="2 tokens for a layout of 3"):
        m(torch.tensor([1, 2], device=DEVICE), None, None, layout)


def test_pieces_write_attention_into_their_buffer_as_the_torch_path_does():
    """A PIECEWISE step's pieces (run eagerly) with the fused ops, whose attention kernel writes
    the pieces' static buffer itself, against the torch ops, which copy into it."""
    m = model()
    for r in range(3):
        run(m, [(r, 5, 0)], PROMPT[:5], {r: [0, -1, 2][r]})
    fused = copy.deepcopy(m)
    fused.fused = True
    step = Step(tuple(Piece(r, a, n, 5, True, True) for r, a, n in [(0, 0, 1), (1, -1, 3), (2, 2, 4)]))
    layout = MixedLayout.of(step, {r: r for r in range(3)})
    buf = MetaBuffer(8, 3, DEVICE)
    buf.load(buf.pack(step.token_adapters)[0])
    lora = LoRAStep(get_backend("torch"), buf.meta, 3, 0.5)
    ids = torch.arange(30, 38, device=DEVICE)
    outs = []
    for mm in (fused, m):
        attn = torch.full((16, CFG.heads * CFG.head_dim), float("nan"), device=DEVICE)
        outs.append(PiecewiseStep(mm, ids, attn, lambda: lora).run_eager(layout))
        assert not attn[:8].isnan().any()
    torch.testing.assert_close(outs[0], outs[1], **TOL)


def test_the_gpu_paths_two_kernels_give_the_torch_paths_step():
    """A mixed step with the model's fused ops (as on a GPU: rotary and cache writes in one kernel,
    then one varlen attention launch a layer) against the torch ops: the same logits, the same caches."""
    m = model()
    for r in range(3):
        run(m, [(r, 5, 0)], PROMPT[:5], {r: [0, -1, 2][r]})
    fused = copy.deepcopy(m)
    fused.fused = True
    pieces, adapters, ids = [(0, 1, 5), (1, 3, 5), (2, 6, 5)], {0: 0, 1: -1, 2: 2}, list(range(20, 30))
    torch.testing.assert_close(run(fused, pieces, ids, adapters), run(m, pieces, ids, adapters), **TOL)
    for ours, theirs in zip(fused.layers, m.layers):
        torch.testing.assert_close(ours.cache_k, theirs.cache_k, **TOL)
        torch.testing.assert_close(ours.cache_v, theirs.cache_v, **TOL)
