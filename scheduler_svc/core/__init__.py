"""The paper's core: blocks, sequences, the scheduler, and what a step's output does to
them. Pure Python, no I/O."""
