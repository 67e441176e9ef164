"""Adapters of mixed ranks (``--ranks 8:0.5,64:0.5``): which rank each resident slot's adapter has.

vLLM pads every adapter to ``--max-lora-rank`` (lorabench's ``--rank``): its weights hold R rows
and columns per slice whatever the adapter's own rank, the rest zero, and its kernels compute
all R. A sweep given ``--ranks`` builds the slots so (zero-padded) and also runs lorabench's
kernels as ``<backend>+unpadded``, which read each slot's rank and skip its padding: the two
side by side are what the padding costs.
"""

from dataclasses import dataclass

from lorabench.kernels import RANKS


@dataclass(frozen=True)
class RankMix:
    """Adapter ranks and the share of the resident slots each takes, e.g. ((8, 0.5), (64, 0.5))."""

    shares: tuple[tuple[int, float], ...]

    def __str__(self) -> str:
        return ",".join(f"{r}:{f:g}" for r, f in self.shares)

    @property
    def largest(self) -> int:
        return max(r for r, _ in self.shares)

    def slot_ranks(self, max_loras: int) -> tuple[int, ...]:
        """Each slot's rank: the slots hold the mix as nearly as ``max_loras`` allows, interleaved
        (slot i takes the rank furthest behind its share of i + 1 slots; ties: the order given)
        so that the low slots a skewed workload favours (zipf) hold the mix too. A fixed point's
        batch draws its n slots at random, so its ranks are the mix on average, not exactly."""
        taken = [0] * len(self.shares)
        out = []
        for i in range(max_loras):
            j = max(range(len(self.shares)), key=lambda j: ((i + 1) * self.shares[j][1] - taken[j], -j))
            taken[j] += 1
            out.append(self.shares[j][0])
        return tuple(out)


def parse_ranks(text: str, rank: int) -> RankMix:
    """``R:F,R:F,...`` (shares summing to 1; a bare ``R`` is all of them) -> RankMix; ValueError
    naming what is wrong. Every rank is one vLLM allows, at most ``rank`` (what they are padded to)."""
    shares = []
    for part in (p.strip() for p in str(text).split(",")):
        r_text, _, f_text = part.partition(":")
        try:
            r, f = int(r_text), float(f_text) if f_text else 1.0
        except ValueError:
            raise ValueError(f"{part!r} is not RANK:SHARE (e.g. 8:0.5,64:0.5)") from None
        if r not in RANKS:
            raise ValueError(f"rank {r} is not one vLLM allows ({', '.join(map(str, RANKS))})")
        if r > rank:
            raise ValueError(f"rank {r} is above --rank {rank}, the rank adapters are padded to (vLLM's --max-lora-rank)")
        if not 0 < f <= 1:
            raise ValueError(f"share {f_text} of rank {r} is not in (0, 1]")
        if any(r == seen for seen, _ in shares):
            raise ValueError(f"rank {r} is given twice")
        shares.append((r, f))
    if not shares or abs(sum(f for _, f in shares) - 1) > 1e-6:
        raise ValueError(f"the shares of {text!r} sum to {sum(f for _, f in shares):g}, not 1")
    return RankMix(tuple(shares))
