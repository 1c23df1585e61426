"""The jobs of the ``engine-core`` script: ``run`` (RL, :mod:`engine_core_roles.jobs.rl`),
``train`` (SFT, :mod:`engine_core_roles.jobs.sft`), their recipes and command line
(:mod:`engine_core_roles.jobs.cli`), and what a run writes for people to read
(:mod:`engine_core_roles.jobs.tracking`, and the trackers of
:mod:`engine_core_roles.jobs.trackers`).
"""
