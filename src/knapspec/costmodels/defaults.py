"""The cost model a decoder gets when it is given none: online calibration on top of this
machine's stored (or quickly measured) profile. Where profiles live is
:mod:`knapspec.costmodels.store`; its names are re-exported here for older imports
(``load_profile_for`` is :func:`~knapspec.costmodels.store.load_or_measure_profile`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from knapspec.costmodels.linear import FittedLinearCostModel
from knapspec.costmodels.online import OnlineCalibratedCostModel
from knapspec.costmodels.store import PROFILE_ENV, default_profile_path, load_or_measure_profile

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine

load_profile_for = load_or_measure_profile


def default_cost_model(
    engine: SublayerEngine, *, progress: bool = False
) -> OnlineCalibratedCostModel:
    """An online-calibrated model whose prior is this machine's (possibly quick) profile."""
    profile = load_or_measure_profile(engine, progress=progress)
    return OnlineCalibratedCostModel(FittedLinearCostModel.from_profile(profile))


__all__ = [
    "PROFILE_ENV",
    "default_cost_model",
    "default_profile_path",
    "load_or_measure_profile",
    "load_profile_for",
]
