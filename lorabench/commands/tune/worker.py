"""One worker of a tune spread over GPUs (``lorabench.commands.tune.spread``): tunes its share of
the shapes on its GPU and sends (``TUNE``) its GPU first (``WorkerGpu``), then one ``Measurement``
per timed config and a ``ShapeDone`` after each shape; the tune that started it writes the folder.

Run as ``python -m lorabench.runtime.lifeline PARENT lorabench.commands.tune.worker <
message.json`` (``{"spec", "shapes", "rows", "command", "session"}``), as executors run a sweep's
workers."""

import json
import os
import socket
import sys
from dataclasses import dataclass

from rich.console import Console

from lorabench.commands.tune.search import Tuner, pdl_off
from lorabench.commands.tune.shapes import Shape
from lorabench.config.tune_spec import TuneSpec
from lorabench.runtime import env
from lorabench.runtime.protocol import Protocol


@dataclass(frozen=True)
class WorkerGpu:
    """Where the worker tunes: its GPU's name (None on the CPU) and its host and GPU, as rows say it."""

    gpu: str | None
    where: str


@dataclass(frozen=True)
class Measurement:
    """One row of the tune's cache (``lorabench.storage.tune_files`` checks its fields)."""

    row: dict


@dataclass(frozen=True)
class ShapeDone:
    label: str
    timed: int  # the shape's rows in the cache


TUNE = Protocol({"env": WorkerGpu, "cache": Measurement, "shape": ShapeDone})


def shape_of(raw: dict) -> Shape:
    return Shape(**{**raw, "key": tuple(raw["key"]), "slices": tuple(raw["slices"])})


def main() -> None:
    sys.stdout = sys.stderr  # stdout carries the protocol only
    message = json.loads(sys.stdin.read())
    spec = TuneSpec(**message["spec"])
    found = env.collect(spec.device)
    pinned = os.environ.get("CUDA_VISIBLE_DEVICES")  # the GPU the executor gave this worker, by UUID
    where = f"{socket.gethostname()} {found.gpu_uuid or pinned or 'cpu'}"
    TUNE.emit(WorkerGpu(found.gpu_name, where))
    tuner = Tuner(spec, message["command"], Console(file=sys.stderr), rows=message["rows"],
                  sink=lambda row: TUNE.emit(Measurement(row)), where=where)
    tuner.session = message["session"]
    with pdl_off():
        for raw in message["shapes"]:
            shape = shape_of(raw)
            tuner.tune(shape)
            TUNE.emit(ShapeDone(shape.label, len(tuner.cache.of(shape))))


if __name__ == "__main__":
    main()
