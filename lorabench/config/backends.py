"""What a row's ``kernels`` column names: a backend, with its default configs or a tune's, padding
every adapter to the rank (as vLLM does) or skipping each one's padding (``+unpadded``)."""

from dataclasses import dataclass

from lorabench.errors import UserError
from lorabench.kernels import BACKENDS

TUNED_SUFFIX = "+tuned"
UNPADDED_SUFFIX = "+unpadded"


@dataclass(frozen=True)
class KernelsLabel:
    """``triton``, ``fused+tuned``, ...: the backend a sweep runs and whether it runs with the
    configs of ``--tuned DIR`` (a ``lorabench tune`` folder) instead of its defaults."""

    backend: str
    tuned: bool = False
    unpadded: bool = False  # adapters of mixed ranks (--ranks), each computed at its own rank

    @classmethod
    def of(cls, text: str) -> "KernelsLabel":
        """The label a ``kernels`` value names, unchecked (rows of any run)."""
        text = text.strip()
        unpadded = UNPADDED_SUFFIX in text
        text = text.replace(UNPADDED_SUFFIX, "")
        return cls(text.removesuffix(TUNED_SUFFIX), text.endswith(TUNED_SUFFIX), unpadded)

    @classmethod
    def parse(cls, text: str) -> "KernelsLabel":
        """The label, or ValueError for an unknown backend or ``+tuned`` on one that cannot be tuned."""
        label = cls.of(text)
        backend = label.backend
        if (backend not in BACKENDS or (label.tuned and not BACKENDS[backend].tunable)
                or (label.unpadded and not BACKENDS[backend].unpadded)):
            tunable = ", ".join(b + TUNED_SUFFIX for b, info in BACKENDS.items() if info.tunable)
            unpadded = ", ".join(b + UNPADDED_SUFFIX for b, info in BACKENDS.items() if info.unpadded)
            raise ValueError(f"unknown backend {text!r} (choose from {', '.join(BACKENDS)}; {tunable} with --tuned DIR; "
                             f"{unpadded} with --ranks)")
        return label

    def __str__(self) -> str:
        return self.backend + (TUNED_SUFFIX if self.tuned else "") + (UNPADDED_SUFFIX if self.unpadded else "")

    @property
    def vllm(self) -> bool:
        """vLLM's own ops, under vLLM's runner rules."""
        return self.backend == "vllm"

    @property
    def order(self) -> float:
        """Report order: backends as registered, its "+unpadded" and "+tuned" runs right after its defaults."""
        names = list(BACKENDS)
        return (names.index(self.backend) if self.backend in names else len(names)) + 0.5 * self.tuned + 0.25 * self.unpadded


def require_vllm_dtype(dtype: str) -> None:
    """vLLM's LoRA ops take half precision only: one line otherwise."""
    if dtype == "float32":
        raise UserError("--kernels vllm: vLLM's LoRA ops take float16 or bfloat16 (--dtype float16)")


def backend_of(label: str) -> str:
    """The backend a ``kernels`` column value runs: ``fused+tuned`` -> ``fused``."""
    return KernelsLabel.of(label).backend


def label_order(label: str) -> float:
    """Report order of a ``kernels`` column value (unknown backends last)."""
    return KernelsLabel.of(label).order
