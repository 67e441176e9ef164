"""linear_bench variants over EXPAND_PROGRAMS and program sharing, as run on the H200 at git 84b31f7
(the kernels with sharing, since reverted; it does not run against the current kernels). From the
repository root at that commit:
    python results/reference-shrink/share-linear-bench/ep_bench.py --max-loras 32 --points 32:1:32,32:32:32
"""
import sys, json, os
sys.path.insert(0, "scripts")
import linear_bench as lb
from lorabench.kernels import triton_lora

def with_ep(ep):
    def apply(*a, **kw):
        old = triton_lora.EXPAND_PROGRAMS
        triton_lora.EXPAND_PROGRAMS = ep
        try:
            triton_lora.lora_apply(*a, **kw)
        finally:
            triton_lora.EXPAND_PROGRAMS = old
    return apply

BIG = 1 << 30
V = {"before(no-share,ep-inf)": (with_ep(BIG), True, False), "share,ep-inf": (with_ep(BIG), True, True),
     "share,ep2048": (with_ep(2048), True, True), "share,ep1024": (with_ep(1024), True, True),
     "share,ep512": (with_ep(512), True, True)}
lb.variants = lambda tuned: V
sys.argv = ["linear_bench"] + sys.argv[1:]
lb.main()
