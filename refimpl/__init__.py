"""refimpl: a reference implementation of the collectives, compiler passes and symmetric
memory that SPEC.md specifies.

Where torch sees a GPU, importing the package imports the CUDA backend of symmetric memory
(refimpl/_symm_mem_cuda.py), which registers its allocator for "cuda" (SM-1, SM-21);
refimpl.symmetric_memory finds it by device type and imports no backend. On a machine
without CUDA the package imports nothing but torch here.
"""

import torch

if torch.cuda.is_available():
    import refimpl._symm_mem_cuda  # noqa: F401  (registers the "cuda" allocator)
