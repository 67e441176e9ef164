"""From measured rows to answers (pandas only, no torch): expected steps, the cost model, the
optimiser behind strategy auto, the roofline and the recommendation."""
