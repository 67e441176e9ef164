"""lorabench: benchmark and autotuning harness for multi-LoRA CUDA-graph specialisation."""

__version__ = "0.1.0"
