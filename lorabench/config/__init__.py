"""What a run is asked to do, checked up front: specs and flags, strategies and the dispatch
rule, workloads and traces, model shapes, the plan of jobs a sweep's workers run."""
