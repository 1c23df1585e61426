"""Testing support: the engine and rollout conformance kits and what they run on.

- :mod:`engine_core.testing.plugin`: the pytest plugin (``pytest --engine-core-backend=NAME``,
  ``pytest --engine-core-rollout=NAME``).
- :mod:`engine_core.testing.rollout_kit`: the rollout kit's checks and oracle;
  :mod:`engine_core.testing.rollout_contract` its tests.
- :mod:`engine_core.testing.contract`: the fixtures that run the kit's processes, and the
  contract tests gathered from :mod:`engine_core.testing.checks`.
- :mod:`engine_core.testing.checks`: one module per concern, each check beside its contract
  tests, registered with the capabilities it needs.
- :mod:`engine_core.testing.kit`: the entry points of the kit's processes (one per layout), and
  the helpers other tests reuse.
- :mod:`engine_core.testing.oracle`: the saved models and batches, and plain transformers'
  figures on them.
- :mod:`engine_core.testing.drive`: building and driving an engine through ``BaseEngine``.
- :mod:`engine_core.testing.models`: tiny models, batches and a loss, built from configs.
- :mod:`engine_core.testing.distributed`: ``run_distributed``, a multi-process launcher.
"""
