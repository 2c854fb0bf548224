"""Drafters: proposers of draft tokens (sub-network, prompt lookup), their records and the
lookup's online acceptance estimates. See :mod:`knapspec.drafters.base`."""

from knapspec.drafters.acceptance import LookupAcceptance, LookupAcceptanceConfig
from knapspec.drafters.base import (
    DRAFTERS,
    LOOKUP,
    NO_DRAFT,
    SUBNETWORK,
    BatchDraftRequest,
    Draft,
    Drafter,
    DraftRequest,
    DraftTarget,
    Verification,
)
from knapspec.drafters.lookup import LookupConfig, LookupDrafter, LookupIndex
from knapspec.drafters.subnetwork import SubnetworkConfig, SubnetworkDrafter

__all__ = [
    "DRAFTERS",
    "LOOKUP",
    "NO_DRAFT",
    "SUBNETWORK",
    "BatchDraftRequest",
    "Draft",
    "DraftRequest",
    "DraftTarget",
    "Drafter",
    "LookupAcceptance",
    "LookupAcceptanceConfig",
    "LookupConfig",
    "LookupDrafter",
    "LookupIndex",
    "SubnetworkConfig",
    "SubnetworkDrafter",
    "Verification",
]
