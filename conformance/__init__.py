"""The conformance suite: runs SPEC.md's cases against any backend (see conformance/README.md)."""
