"""Model families FCA knows how to audit. Each file holds one architecture, top to bottom; importing
this package registers each family's loader with `fca.engine.loading`."""

from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM

from fca.engine.loading import load_strict, read_config, read_state_dict, register_loader
from fca.engine.models.featuregate import FeatureGateConfig, FeatureGateModel, build_featuregate
from fca.engine.models.hf_moe import MOE_MODEL_TYPES, adapt_moe, expert_execution, load_hf_moe
from fca.engine.models.muddpythia import MODEL_TYPE as MUDDPYTHIA_TYPE
from fca.engine.models.muddpythia import MUDDPythia, MUDDPythiaConfig, load_muddpythia


def _load_featuregate(path: Path) -> FeatureGateModel:
    config = FeatureGateConfig.from_dict(read_config(path))
    return load_strict(FeatureGateModel(config), read_state_dict(path), path)


register_loader(FeatureGateConfig.model_type, _load_featuregate)
# So that transformers' Auto classes open a FeatureGate directory too (AutoModelForCausalLM.from_pretrained).
AutoConfig.register(FeatureGateConfig.model_type, FeatureGateConfig, exist_ok=True)
AutoModelForCausalLM.register(FeatureGateConfig, FeatureGateModel, exist_ok=True)
register_loader(MUDDPYTHIA_TYPE, load_muddpythia)
for _moe_type in MOE_MODEL_TYPES:  # Hugging Face MoE directories, adapted with router sites
    register_loader(_moe_type, load_hf_moe)

__all__ = ["FeatureGateConfig", "FeatureGateModel", "build_featuregate", "MUDDPythia", "MUDDPythiaConfig"]
__all__ += ["adapt_moe", "expert_execution"]
