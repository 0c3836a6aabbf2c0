"""The garbage collector's view of a long-running service process."""

from __future__ import annotations

import gc

# Net new containers between young collections (CPython's default: 700). A step allocates
# thousands, most freed at once; fewer, larger young collections cost less in all.
YOUNG_THRESHOLD = 10_000


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive (modules, the model's and tokenizer's
    Python objects, the web framework) to the collector's permanent generation.

    Each step allocates thousands of containers, so collections run several times a step;
    an oldest-generation pass would otherwise walk these hundreds of thousands of objects
    that live as long as the process, and it took half a busy scheduler's CPU. Objects
    allocated later (requests, sequences) are collected as before.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
