"""What runs on the device: the model, the graph dispatcher, the correctness check, timing and
the sweep's worker process. Everything here but ``lifeline`` imports torch."""
