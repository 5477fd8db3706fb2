"""Model families FCA knows how to audit. Each file holds one architecture, top to bottom, and ends
with its `Family` (`fca.engine.families`); importing this package registers them all."""

from transformers import AutoConfig, AutoModelForCausalLM

from fca.engine.models.featuregate import (
    FeatureGateConfig,
    FeatureGateModel,
    build_featuregate,
)
from fca.engine.models.hf_moe import adapt_moe, expert_execution
from fca.engine.models.muddpythia import MUDDPythia, MUDDPythiaConfig

# So that transformers' Auto classes open a FeatureGate directory too (AutoModelForCausalLM.from_pretrained).
AutoConfig.register(FeatureGateConfig.model_type, FeatureGateConfig, exist_ok=True)
AutoModelForCausalLM.register(FeatureGateConfig, FeatureGateModel, exist_ok=True)

__all__ = ["FeatureGateConfig", "FeatureGateModel", "build_featuregate", "MUDDPythia", "MUDDPythiaConfig"]
__all__ += ["adapt_moe", "expert_execution"]
