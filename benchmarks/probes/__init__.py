"""Investigation probes: scripts that each answered one development question (what a kernel
costs by row count, how close it runs to the CPU's limits, how many tokens per step a proposer
earns on replay, ...). Kept runnable (``python benchmarks/probes/x.py`` or ``python -m
benchmarks.probes.x``) so their RESULTS.md sections can be rerun, but not maintained as user
tools: see benchmarks/README.md."""
