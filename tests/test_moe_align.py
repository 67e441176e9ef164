"""The sorted path's metadata for expert LoRA against a plain Python construction of vLLM's layout."""

import pytest
import torch
from conftest import DEVICE, requires_cuda

from lorabench.kernels.moe_align import align_blocks, max_num_tokens_padded, moe_lora_align_block_size, uses_per_token_path


def python_layout(topk_ids, token_lora_mapping, lora_ids, adapter_enabled, experts, block_size, max_loras):
    """The layout written entry by entry: per filled slot, each expert's entries in order, padded."""
    tokens, top_k = len(topk_ids), len(topk_ids[0]) if topk_ids else 0
    numel = tokens * top_k
    width = max_num_tokens_padded(numel, experts, block_size)
    blocks = -(-width // block_size)
    sorted_ids = [[numel] * width for _ in range(max_loras)]
    expert_ids = [[-1] * blocks for _ in range(max_loras)]
    post_pad = [0] * max_loras
    for slot in sorted({i for i in lora_ids if 0 <= i < max_loras}):
        if not adapter_enabled[slot]:
            continue
        at = 0
        for e in range(experts):
            mine = [t * top_k + k for t in range(tokens) for k in range(top_k)
                    if token_lora_mapping[t] == slot and topk_ids[t][k] == e]
            sorted_ids[slot][at:at + len(mine)] = mine
            for b in range(-(-len(mine) // block_size)):
                expert_ids[slot][at // block_size + b] = e
            at += -(-len(mine) // block_size) * block_size
        post_pad[slot] = at
    return sorted_ids, expert_ids, post_pad


def check(topk_ids, mapping, lora_ids, enabled, experts, block_size, max_loras):
    """Both implementations (torch ops, and the one-launch Triton kernel) against the Python layout."""
    args = (torch.tensor(topk_ids, dtype=torch.int32).reshape(len(topk_ids), -1), torch.tensor(mapping, dtype=torch.int32),
            torch.tensor(lora_ids, dtype=torch.int32), torch.tensor(enabled, dtype=torch.int32))
    got = moe_lora_align_block_size(*args, experts, block_size, max_loras)
    launched = align_blocks(*(a.to(DEVICE) for a in args[:1]), experts, block_size, max_loras,
                            *(a.to(DEVICE) for a in args[1:]))  # the Triton kernel: on the GPU where there is one
    want = python_layout(topk_ids, mapping, lora_ids, enabled, experts, block_size, max_loras)
    for g, t, w, name in zip(got, launched, want, ("sorted_token_ids", "expert_ids", "num_tokens_post_padded")):
        assert g.dtype == torch.int32 and g.tolist() == w, name
        assert t.dtype == torch.int32 and t.cpu().tolist() == w, f"{name} (Triton)"
    return got


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (7, 60, 4), (9, 32, 8)])
def test_the_base_layout_is_one_slot_holding_every_token(tokens, experts, top_k):
    g = torch.Generator().manual_seed(tokens)
    topk = [torch.randperm(experts, generator=g)[:top_k].tolist() for _ in range(tokens)]
    got = align_blocks(torch.tensor(topk, dtype=torch.int32, device=DEVICE), experts, 16)
    want = python_layout(topk, [0] * tokens, [0], [1], experts, 16, 1)
    assert [t.cpu().tolist() for t in got] == [list(w) for w in want]


@pytest.mark.parametrize("experts,top_k", [(8, 2), (3, 1), (16, 4)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("tokens", [1, 5, 17])
def test_random_batches_mixing_base_tokens_match_the_layout_at_every_active_count(experts, top_k, block_size, tokens):
    g = torch.Generator().manual_seed(tokens * 131 + experts * 7 + block_size)
    max_loras = 4
    topk = [torch.randperm(experts, generator=g)[:top_k].tolist() for _ in range(tokens)]
    for active in range(1, max_loras + 1):
        slots = torch.randperm(max_loras, generator=g)[:active].tolist()
        mapping = [slots[i] if i < active else (slots + [-1])[int(torch.randint(active + 1, (1,), generator=g))]
                   for i in range(tokens)]  # each active slot a token first; then slots and base tokens mixed
        lora_ids = ([-1] if -1 in mapping else []) + sorted(set(mapping) - {-1})
        lora_ids += [-1] * (max_loras + 1 - len(lora_ids))  # the grid's max_loras + 1 columns
        check(topk, mapping, lora_ids, [1] * max_loras, experts, block_size, max_loras)


def test_a_disabled_slot_an_unlisted_slot_and_an_expert_with_no_tokens_stay_empty():
    topk = [[0, 2], [2, 0], [0, 2], [2, 2]]  # experts 1 and 3 get nothing; ties within a token
    mapping = [0, 1, 2, -1]
    sorted_ids, expert_ids, post_pad = check(topk, mapping, [-1, 0, 1], [1, 0, 1], 4, 2, 3)
    assert post_pad.tolist() == [4, 0, 0]  # slot 1 has no expert LoRA; slot 2 is not in lora_ids
    assert sorted_ids[0].tolist()[:4] == [0, 8, 1, 8] and expert_ids[0].tolist()[:3] == [0, 2, -1]
    assert (sorted_ids[1:] == 8).all() and (expert_ids[1:] == -1).all()


def test_expert_ids_past_the_layers_experts_are_dropped():
    sorted_ids, expert_ids, post_pad = check([[0, 7], [7, 1]], [0, 0], [0], [1], 4, 2, 1)
    assert post_pad.tolist() == [4] and 1 not in sorted_ids.tolist()[0][:4]


def test_the_row_length_is_vllms():
    assert max_num_tokens_padded(64 * 8, 128, 16) == 64 * 8 + 128 * 15
    assert max_num_tokens_padded(2 * 8, 128, 16) == 2 * 8 * 16  # fewer entries than experts: a block each
    assert max_num_tokens_padded(100, 8, 16, pad_sorted_ids=True) == 224  # 100 + 120 rounded up to 16


def test_vllms_per_token_path_is_taken_for_small_batches():
    # Qwen3-30B-A3B: 128 experts, top-8; the per-token path up to 2 · max_loras tokens.
    assert uses_per_token_path(8, 8, 128, 4) and not uses_per_token_path(9, 8, 128, 4)
    assert not uses_per_token_path(1, 8, 128, 4, fully_sharded=True)
    assert not uses_per_token_path(1, 2, 8, 1)  # Mixtral at 1 slot: 16 > 8


def test_a_block_size_below_one_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        moe_lora_align_block_size(torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                  torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1, 0, 1)


@requires_cuda
def test_the_layout_is_built_inside_a_cuda_graph_for_each_replays_batch():
    """Static shapes and no host synchronisation: captured once, replayed over other routings."""
    experts, top_k, block_size, max_loras, tokens = 128, 8, 16, 4, 24
    g = torch.Generator().manual_seed(0)

    def batch():
        topk = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).int()
        mapping = torch.randint(-1, max_loras, (tokens,), generator=g).int()
        lora_ids = torch.full((max_loras + 1,), -1, dtype=torch.int32)
        present = sorted(set(mapping.tolist()))
        lora_ids[:len(present)] = torch.tensor(present, dtype=torch.int32)
        return topk, mapping, lora_ids

    enabled = torch.ones(max_loras, dtype=torch.int32, device="cuda")
    static = [t.cuda() for t in batch()]
    torch_ops = lambda: moe_lora_align_block_size(*static, enabled, experts, block_size, max_loras)  # noqa: E731
    one_launch = lambda: align_blocks(static[0], experts, block_size, max_loras, *static[1:], enabled)  # noqa: E731
    align = lambda: (*torch_ops(), *one_launch())  # noqa: E731
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        align()  # warm-up off the capture stream, as torch's graph docs ask
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = align()
    for _ in range(3):
        new = batch()
        for s, n in zip(static, new):
            s.copy_(n)
        graph.replay()
        want = python_layout(new[0].tolist(), new[1].tolist(), new[2].tolist(), [1] * max_loras, experts, block_size,
                             max_loras)
        for got, w in zip(out, want + want):
            assert got.cpu().tolist() == w
