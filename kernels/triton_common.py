"""Small pieces shared by the Triton kernels of this package.

The kernels run compiled on a GPU and, for tests, under the Triton interpreter on a CPU
(``TRITON_INTERPRET=1``). The interpreter stores bf16 tensors as raw ``uint16`` and its
``tl.dot`` multiplies those raw integers, and its fp16 products bypass BLAS (very slow), so
there the operands of every matrix product are upcast to fp32 first (exact for bf16/fp16, and
the products accumulate in fp32 as on tensor cores). Compiled kernels keep bf16/fp16 operands so
that the products run on tensor cores.
"""

from __future__ import annotations

import os

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


def interpreting(kernel=None) -> bool:
    """True when ``kernel`` (default: kernels defined from now on) runs in the CPU interpreter.

    Triton picks the interpreter when a ``@triton.jit`` function is defined, from
    ``TRITON_INTERPRET``; asking the kernel object keeps the answer right if the variable
    changes later.
    """
    if kernel is not None:
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(kernel, InterpretedFunction)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def upcast_dots(kernel) -> bool:
    """Whether ``kernel``'s matrix products must take fp32 operands (the interpreter, see above)."""
    return interpreting(kernel)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def check_head_dim(head_dim: int) -> None:
    """Tiles need a power-of-two width of at least 16 for ``tl.dot``; other widths are padded."""
    if head_dim < 1 or head_dim > 256:
        raise ValueError(f"head_dim must be in [1, 256], got {head_dim}")
