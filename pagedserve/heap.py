"""The garbage collector's view of a long-running service process."""

from __future__ import annotations

import gc


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
