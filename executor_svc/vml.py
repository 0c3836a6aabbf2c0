"""oneMKL's vector math functions, settled before any thread races to pick their kernels.

ATen computes a contiguous float ``cos``, ``sin``, ``exp``, ``log``, ``sqrt``, ``tanh`` ...
with MKL's VML, each intra-op thread on its chunk. oneMKL 2024.2 (torch's CPU wheels here)
picks a function's kernel on its first call, and when that first call runs on several
threads at once, one thread can run a low-accuracy kernel for its whole chunk
(pytorch/pytorch#188792; fixed from oneMKL 2025.0). The rope tables are such a first call:
under load, now and then, the cos of every position from 512 on came out up to 1.5e-4 off,
and stayed so for the executor's life. One call on one element per function and dtype, on
one thread, settles each kernel before any parallel use.
"""

from __future__ import annotations

import torch

# The float functions ATen hands to VML (aten/src/ATen/cpu/vml.h).
VML_FUNCTIONS = (
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "log",
    "log10",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)


def settle_vml_kernels() -> None:
    """Call each VML function once, alone; later calls from many threads reuse its kernel."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for name in VML_FUNCTIONS:
            getattr(torch, name)(x)
