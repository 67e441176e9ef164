"""A mixed step's PIECEWISE graphs: the model split at attention, as vLLM splits it.

For one key (token bucket, launch count) the step's L + 1 pieces (``LlamaLoRA.first_piece``,
``piece``) are captured as CUDA graphs in the dispatcher's pool; attention, which depends on the
step's layout (chunk lengths, contexts), runs eagerly between them and writes its output into one
static buffer the next piece reads. Each piece reads the previous piece's outputs where capture
left them. The logits are not in the pieces: the dispatcher computes those of the tokens a step
samples (each piece's last), as vLLM does outside its graphs.

Memory as vLLM keeps it: while one key is captured, every piece's outputs are held, so no piece
of that key reuses another's; once captured, the key keeps only non-owning views of them
(``graphs.weak_view``, vLLM's ``weak_ref_tensors``), so the next key's pieces reuse the pool's
blocks. That is safe because a step replays one key's pieces in order and nothing else writes the
pool in between; it also means a step's outputs last until the next step runs, as with vLLM.

Without graphs (the CPU path) the pieces run eagerly over the same padded bucket, attention
over the layout's tokens alone, so dispatch and the pieces' data flow are exercised identically.
"""

from collections.abc import Callable

import torch

from lorabench.runtime.graphs import weak_view
from lorabench.runtime.mixed_attention import MixedLayout, index_of
from lorabench.runtime.model import LlamaLoRA, LoRAStep


class PiecewiseStep:
    """One key's pieces over the first ``tokens`` static input ids."""

    def __init__(self, model: LlamaLoRA, input_ids: torch.Tensor, attn: torch.Tensor,
                 lora: Callable[[], LoRAStep | None]):
        """input_ids: the bucket's static token ids [tokens]; attn: the static buffer attention
        writes into [>= tokens, heads * head_dim]; lora: the step's ``LoRAStep`` (None: the base
        model), built when the pieces run or are captured."""
        self.model, self.input_ids, self.lora = model, input_ids, lora
        self.tokens = input_ids.shape[0]
        self.attn = attn[: self.tokens]
        self.pieces = len(model.layers) + 1
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # each piece's (x, qkv or final hidden states), captured

    def _piece(self, i: int, lora, x) -> tuple[torch.Tensor, torch.Tensor]:
        if i == 0:
            return self.model.first_piece(self.input_ids, lora)
        return self.model.piece(i, self.attn, x, lora)

    def run_eager(self, layout: MixedLayout | None = None) -> torch.Tensor:
        """Every piece eagerly; attention between them over ``layout`` (None: skipped, the
        warm-up's compile pass). Returns the bucket's final hidden states."""
        lora, x = self.lora(), None
        positions = None if layout is None else index_of(layout, self.input_ids.device).positions
        for i in range(self.pieces):
            x, out = self._piece(i, lora, x)
            if layout is not None and i < self.pieces - 1:
                self._attend(i, out, positions, lora, layout)
        return out

    def capture(self, pool) -> None:
        """Capture the pieces in ``pool``, holding their outputs until the last is captured."""
        lora, x, graphs, outputs = self.lora(), None, [], []
        for i in range(self.pieces):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                x, out = self._piece(i, lora, x)
            graphs.append(graph)
            outputs.append((x, out))
        self.graphs = graphs
        self.outputs = [(weak_view(a), weak_view(b)) for a, b in outputs]

    def __call__(self, layout: MixedLayout) -> torch.Tensor:
        """One mixed step over the metadata already loaded: the bucket's final hidden states
        [tokens, hidden] (``LlamaLoRA.logits`` makes the logits of those it samples)."""
        if self.graphs is None:
            return self.run_eager(layout)
        lora = self.lora()
        positions = index_of(layout, self.input_ids.device).positions
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if i < self.pieces - 1:
                self._attend(i, self.outputs[i][1], positions, lora, layout)
        return self.outputs[-1][1]

    def _attend(self, i: int, qkv: torch.Tensor, positions, lora, layout: MixedLayout) -> None:
        n = layout.tokens
        self.model.attention(i, qkv[:n], positions, lora, layout, out=self.attn[:n])
