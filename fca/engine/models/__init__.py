"""Model families FCA knows how to audit. Each file holds one architecture, top to bottom, and ends
with its `Family` (`fca.engine.family`), except `small_gpt`, the parts FeatureGate and mixture of depths
share; `BUILTIN_FAMILIES` lists them for the registry (`fca.engine.families`), which adds them on its
first lookup."""

from transformers import AutoConfig, AutoModelForCausalLM

from fca.engine.models import featuregate, hf_moe, mixture_of_depths, muddpythia
from fca.engine.models.featuregate import (
    FeatureGateConfig,
    FeatureGateModel,
    build_featuregate,
)
from fca.engine.models.hf_moe import adapt_moe, expert_execution
from fca.engine.models.muddpythia import MUDDPythia, MUDDPythiaConfig

BUILTIN_FAMILIES = (featuregate.FAMILY, muddpythia.FAMILY, mixture_of_depths.FAMILY, *hf_moe.FAMILIES)

# So that transformers' Auto classes open a FeatureGate directory too (AutoModelForCausalLM.from_pretrained).
AutoConfig.register(FeatureGateConfig.model_type, FeatureGateConfig, exist_ok=True)
AutoModelForCausalLM.register(FeatureGateConfig, FeatureGateModel, exist_ok=True)

__all__ = ["FeatureGateConfig", "FeatureGateModel", "build_featuregate", "MUDDPythia", "MUDDPythiaConfig"]
__all__ += ["adapt_moe", "expert_execution", "BUILTIN_FAMILIES"]
