"""The batch search: each row's drafter and γ for one batched round, priced as a whole.

:mod:`~knapspec.planners.batch.base` (what a batch loop asks a policy each round, and the
plain and fixed-length policies), :mod:`~knapspec.planners.batch.policy` (the cost-model
search that prices each round), :mod:`~knapspec.planners.batch.pricing` (batched verify
and draft costs, their online calibration), :mod:`~knapspec.planners.batch.allocation`
(the best lookup allocation under each cap, every cap in one pass; the vLLM proposer
reuses its greedy order) and :mod:`~knapspec.planners.batch.plan` (the round's plan, the
batch's sub-network and its per-row acceptance). Like every planner, they never touch the
KV cache.
"""

from knapspec.planners.batch.policy import (
    BatchDraftPolicy,
    BatchSubnetwork,
    CostModelBatchPolicy,
    FixedLookupBatchPolicy,
    FixedSubnetworkBatchPolicy,
    PlainBatchPolicy,
    RoundPlan,
)

__all__ = [
    "BatchDraftPolicy",
    "BatchSubnetwork",
    "CostModelBatchPolicy",
    "FixedLookupBatchPolicy",
    "FixedSubnetworkBatchPolicy",
    "PlainBatchPolicy",
    "RoundPlan",
]
