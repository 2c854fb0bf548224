"""Value proxies: how close a draft sub-network is to the full model, and its acceptance α.

Importing this package registers the built-in proxies (``"cosine"``, ``"montecarlo"``) in
:data:`PROXIES` eagerly.
"""

from knapspec.proxies.base import PROXIES, AcceptanceEstimate, ValueProxy
from knapspec.proxies.cosine import CosineProxy, CosineProxyConfig, mean_cosine
from knapspec.proxies.intervals import mean_interval, wilson_interval
from knapspec.proxies.lemma import (
    Certificate,
    HeadGeometry,
    ReferenceMargins,
    certify,
    cosine_bound,
    greedy_margin,
    lemma_states,
    max_row_distance,
    reference_margins,
)
from knapspec.proxies.montecarlo import (
    MonteCarloAcceptanceProxy,
    MonteCarloProxyConfig,
    acceptance_probability,
    coupling_acceptance,
)

__all__ = [
    "PROXIES",
    "AcceptanceEstimate",
    "Certificate",
    "CosineProxy",
    "CosineProxyConfig",
    "HeadGeometry",
    "MonteCarloAcceptanceProxy",
    "MonteCarloProxyConfig",
    "ReferenceMargins",
    "ValueProxy",
    "acceptance_probability",
    "certify",
    "cosine_bound",
    "coupling_acceptance",
    "greedy_margin",
    "lemma_states",
    "max_row_distance",
    "mean_cosine",
    "mean_interval",
    "reference_margins",
    "wilson_interval",
]
