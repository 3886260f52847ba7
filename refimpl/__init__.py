"""refimpl: a reference implementation of the collectives, compiler passes and symmetric
memory that SPEC.md specifies, one flat module per concept (README.md, "Layout").

Importing the package imports nothing: each module loads what it needs. Symmetric
memory finds the backend of a device type when a program first asks for it
(`refimpl.symmetric_memory.BACKEND_MODULES`, SM-1).
"""
