"""The garbage collector's settings for a long-running service process."""

from __future__ import annotations

import gc

# Net new containers between young collections (CPython's default: 700). A step allocates
# thousands, most freed at once; fewer, larger young collections cost less in all.
YOUNG_THRESHOLD = 10_000


def tune_garbage_collector() -> None:
    """Call once started, before serving: collect, then move every object alive (modules,
    the model's and the tokenizer's Python objects, the web framework) to the collector's
    permanent generation, and collect the young generation less often.

    Without the freeze, each oldest-generation pass walks those hundreds of thousands of
    objects that live as long as the process, and a busy step loop triggers such passes
    every few steps. Objects allocated later (requests, sequences) are collected as before.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
