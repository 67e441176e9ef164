"""One worker of a tune spread over GPUs (``lorabench.commands.tune.spread``): tunes its share of
the shapes on its GPU and writes one ``@@cache {row}`` line per measurement, ``@@shape`` after
each shape and ``@@env`` first (its GPU); the tune that started it writes the folder.

Run as ``python -m lorabench.runtime.lifeline PARENT lorabench.commands.tune.worker <
message.json`` (``{"spec", "shapes", "rows", "command", "session"}``), as executors run a sweep's
workers."""

import json
import os
import socket
import sys

from rich.console import Console

from lorabench.commands.tune.search import Tuner, pdl_off
from lorabench.commands.tune.shapes import Shape
from lorabench.config.tune_spec import TuneSpec
from lorabench.runtime import env
from lorabench.runtime.launch import emit


def shape_of(raw: dict) -> Shape:
    return Shape(**{**raw, "key": tuple(raw["key"]), "slices": tuple(raw["slices"])})


def main() -> None:
    sys.stdout = sys.stderr  # stdout carries the protocol only
    message = json.loads(sys.stdin.read())
    spec = TuneSpec(**message["spec"])
    found = env.collect(spec.device)
    pinned = os.environ.get("CUDA_VISIBLE_DEVICES")  # the GPU the executor gave this worker, by UUID
    where = f"{socket.gethostname()} {found.get('gpu_uuid') or pinned or 'cpu'}"
    emit("env", {"gpu": found.get("gpu_name"), "where": where})
    tuner = Tuner(spec, message["command"], Console(file=sys.stderr), rows=message["rows"],
                  sink=lambda row: emit("cache", row), where=where)
    tuner.session = message["session"]
    with pdl_off():
        for raw in message["shapes"]:
            shape = shape_of(raw)
            tuner.tune(shape)
            emit("shape", {"label": shape.label, "timed": len(tuner.cache.of(shape))})


if __name__ == "__main__":
    main()
