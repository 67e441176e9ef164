"""What runs on the device: the model, the graph dispatcher, the correctness check, timing and
the sweep's worker process; and how workers are started and heard (``launch``, ``executors``,
``lifeline``, ``protocol``, ``gpus``, ``telemetry``, ``env``), which import no torch: the sweep's own
process uses them."""
