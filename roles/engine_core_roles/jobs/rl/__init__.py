"""The RL job of ``engine-core run``: its config, the construction of its roles and text pieces,
the run loop, evaluation and the supervised warm-up.
"""
