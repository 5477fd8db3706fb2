"""Model families FCA knows how to audit. Each file holds one architecture, top to bottom; importing
this package registers each family's loader with `fca.loading`."""

from pathlib import Path

from ..loading import load_strict, read_config, read_state_dict, register_loader
from .featuregate import FeatureGateConfig, FeatureGateModel, build_featuregate


def _load_featuregate(path: Path) -> FeatureGateModel:
    config = FeatureGateConfig.from_dict(read_config(path))
    return load_strict(FeatureGateModel(config), read_state_dict(path), path)


register_loader(FeatureGateConfig.model_type, _load_featuregate)

__all__ = ["FeatureGateConfig", "FeatureGateModel", "build_featuregate"]
