"""Testing support: the engine conformance kit and what it runs on.

- :mod:`engine_core.testing.plugin`: the pytest plugin (``pytest --engine-core-backend=NAME``).
- :mod:`engine_core.testing.contract`: the contract tests, one per engine guarantee.
- :mod:`engine_core.testing.kit`: the checks run inside the engine's processes, and baselines.
- :mod:`engine_core.testing.models`: tiny models, batches and a loss, built from configs.
- :mod:`engine_core.testing.distributed`: ``run_distributed``, a multi-process launcher.
"""
