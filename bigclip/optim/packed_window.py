"""The size of the packed AdamW update's windows (optim/packed_update.py), kept apart from that module's torchao
imports so that the memory model (memory/recipe.py) counts a window's scratch without importing torchao."""

# Values one call of the compiled update steps at most (4M): a window's packed copies and temporaries are the step's
# scratch, 14-20 bytes per value measured on CPU (docs/benchmarks.md, bench/plan_check.py's section).
PACKED_WINDOW_VALUES = (1 << 14) * 256
