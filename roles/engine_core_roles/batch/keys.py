"""The names of the fields the roles, the trainer and the episodes add to a batch.

The core's fields (``input_ids``, ``prompt_ids``, ``rollout_log_probs``, ...) are named in
:mod:`engine_core`; these are the ones this layer adds, each produced by one role or stage.
"""

from __future__ import annotations

__all__ = [
    "ADVANTAGES",
    "EPISODE",
    "OLD_LOG_PROBS",
    "OLD_VALUES",
    "REF_LOG_PROBS",
    "RETURNS",
    "RM_SCORES",
    "ROW",
    "ROW_INDEX",
    "TOKEN_LEVEL_SCORES",
    "TRAINER_ROUTES",
    "UNLIKELIHOOD_WEIGHTS",
    "WEIGHT_VERSION",
]

OLD_LOG_PROBS = "old_log_probs"
"""``[B, L]``: the policy's log-probs before the update (``Actor.compute_log_prob``)."""
REF_LOG_PROBS = "ref_log_probs"
"""``[B, L]``: the frozen reference policy's log-probs (``Reference.compute_ref_log_prob``)."""
ADVANTAGES = "advantages"
"""``[B, L]``: each token's advantage (the trainer's estimator)."""
UNLIKELIHOOD_WEIGHTS = "unlikelihood_weights"
"""``[B, L]``: each token's weight of the unlikelihood term in the actor's loss, where the
advantage estimator asks for one (``AdvantageResult.unlikelihood_weights``)."""
OLD_VALUES = "old_values"
"""``[B, L]``: the critic's values before its update (``Critic.compute_values``)."""
RETURNS = "returns"
"""``[B, L]``: the critic's regression targets (GAE returns)."""
TRAINER_ROUTES = "trainer_routed_experts"
"""``[B, L, layers, top_k]``: the experts the actor's own routers chose in the old-log-prob pass
(a mixture of experts under ``trainer.routing_replay``)."""
RM_SCORES = "rm_scores"
"""``[B]``: one reward-model score per sequence (``RewardModel.compute_rm_score``)."""
TOKEN_LEVEL_SCORES = "token_level_scores"
"""``[B, L]``: the reward model's score on each sequence's last token."""
EPISODE = "episode"
"""The field of an episode rollout's result holding each episode's record (a dict: turns, tool
calls and errors, why it ended, the final answer, the environment's reward, the messages)."""
ROW = "row"
"""The field of a prompt batch holding each prompt's dataset row (a dict), for ``reset``."""
ROW_INDEX = "row_index"
"""The field of a prompt batch holding each prompt's row in its dataset ``[B]``."""
WEIGHT_VERSION = "weight_version"
"""``[B]`` int64, in a rollout's result where the rollout records the weight version of every
token it samples (the agents' endpoint): the oldest version among the row's sampled tokens. The
trainer counts a step's samples as its rows' oldest version (their staleness)."""
