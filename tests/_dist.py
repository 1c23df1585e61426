"""The tests' process launcher is the one the conformance kit ships."""

from engine_core.testing.distributed import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
