"""Whether the kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1, read at `@triton.jit` time).

Two of the interpreter's numerics differ from a GPU's (triton 3.9), and the tests state them: its `tl.dot`
multiplies bf16 operands as the uint16 it stores them in, so the kernels widen dot operands to fp32 first
under it (exact for bf16 and fp16 products; only the order of the fp32 sums differs), and it narrows fp32 to
bf16 toward zero, not to nearest.
"""

import triton


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)
