"""The model registry: HF `architectures` names -> the family class that runs them.

A config.json names its class in `architectures` (e.g. ["Qwen3ForCausalLM"]); one without it is found
by its `model_type` (the first architecture registered with that type); a GGUF file by its
`general.architecture`. A family is one file in this folder (a subclass of layers/causal_lm.py's
CausalLM expressing what differs from the shared layers) and one line in ARCHITECTURES;
docs/guides/adding-a-model.md says how.

ModelConfig.from_hf_dict reads the family's `config_fields` through this module: the family files and
layers/ import ModelConfig for annotations only (under TYPE_CHECKING), so that config -> registry ->
families never leads back to config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchgen.engine.models.gemma2 import Gemma2ForCausalLM
from batchgen.engine.models.gemma3 import Gemma3ForCausalLM
from batchgen.engine.models.glm4 import Glm4ForCausalLM
from batchgen.engine.models.gpt_oss import GptOssForCausalLM
from batchgen.engine.models.layers.sequence_classifier import (
    CAUSAL_SUFFIX,
    CLASSIFIER_SUFFIX,
    classifier_class,
)
from batchgen.engine.models.llama import LlamaForCausalLM
from batchgen.engine.models.mistral import MistralForCausalLM
from batchgen.engine.models.mixtral import MixtralForCausalLM
from batchgen.engine.models.olmo2 import Olmo2ForCausalLM
from batchgen.engine.models.phi3 import Phi3ForCausalLM
from batchgen.engine.models.qwen2 import Qwen2ForCausalLM
from batchgen.engine.models.qwen2_moe import Qwen2MoeForCausalLM
from batchgen.engine.models.qwen3 import Qwen3ForCausalLM
from batchgen.engine.models.qwen3_moe import Qwen3MoeForCausalLM

if TYPE_CHECKING:
    from batchgen.engine.models.config import ModelConfig
    from batchgen.engine.models.layers.causal_lm import CausalLM


@dataclass(frozen=True)
class Architecture:
    """One HF architecture the engine runs."""

    model_class: type[CausalLM]
    model_type: str  # config.json's model_type for it (a config without `architectures` is found by it)
    gguf_name: str | None = None  # llama.cpp's `general.architecture`; None: not loaded from GGUF files


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, "llama", gguf_name="llama"),
    "MistralForCausalLM": Architecture(MistralForCausalLM, "mistral", gguf_name="mistral"),
    "Qwen2ForCausalLM": Architecture(Qwen2ForCausalLM, "qwen2", gguf_name="qwen2"),
    "Qwen3ForCausalLM": Architecture(Qwen3ForCausalLM, "qwen3", gguf_name="qwen3"),
    "Olmo2ForCausalLM": Architecture(Olmo2ForCausalLM, "olmo2", gguf_name=None),
    "Glm4ForCausalLM": Architecture(Glm4ForCausalLM, "glm4", gguf_name="glm4"),
    "Phi3ForCausalLM": Architecture(Phi3ForCausalLM, "phi3", gguf_name="phi3"),
    "Gemma2ForCausalLM": Architecture(Gemma2ForCausalLM, "gemma2", gguf_name="gemma2"),
    "Gemma3ForCausalLM": Architecture(Gemma3ForCausalLM, "gemma3_text", gguf_name="gemma3"),
    # Mixture of experts (layers/moe.py). llama.cpp writes Mixtral as "llama" with experts (gguf_loader.py
    # reads such a file as Mixtral).
    "MixtralForCausalLM": Architecture(MixtralForCausalLM, "mixtral", gguf_name=None),
    "Qwen3MoeForCausalLM": Architecture(Qwen3MoeForCausalLM, "qwen3_moe", gguf_name="qwen3moe"),
    "Qwen2MoeForCausalLM": Architecture(Qwen2MoeForCausalLM, "qwen2_moe", gguf_name="qwen2moe"),  # a shared expert
    # attention sinks, alternating sliding windows, experts with biases and a clamped SwiGLU (MXFP4 as published)
    "GptOssForCausalLM": Architecture(GptOssForCausalLM, "gpt_oss", gguf_name=None),
}


# Architectures whose config.json `batchgen plan` reads (ModelConfig.from_hf_dict(is_plan_only=True)) but the
# engine does not run yet: an Architecture whose class only reads the config (constructing it raises).
# None at present (gpt-oss was one until the engine ran it).
PLAN_ONLY_ARCHITECTURES: dict[str, Architecture] = {}


# Sequence classifiers (reward models): `XForSequenceClassification` for every registered `XForCausalLM`,
# the same decoder with a score head (layers/sequence_classifier.py). Derived, so a family added above
# gets its classifier too.
CLASSIFIERS: dict[str, Architecture] = {
    name.removesuffix(CAUSAL_SUFFIX) + CLASSIFIER_SUFFIX: Architecture(
        classifier_class(arch.model_class, name.removesuffix(CAUSAL_SUFFIX) + CLASSIFIER_SUFFIX), arch.model_type)
    for name, arch in ARCHITECTURES.items() if name.endswith(CAUSAL_SUFFIX)
}


def architecture(name: str) -> Architecture:
    """The registered architecture `name` (a causal LM's or a sequence classifier's); KeyError if none."""
    return ARCHITECTURES[name] if name in ARCHITECTURES else CLASSIFIERS[name]


def is_classifier(name: str | None) -> bool:
    """Whether the architecture `name` is a registered sequence classifier (a pooling model)."""
    return name in CLASSIFIERS


def hf_architecture(hf_config: dict) -> str:
    """The registered architecture a parsed config.json names: the first of its `architectures` that
    is registered (a causal LM or a sequence classifier), else (no `architectures`) its model_type's
    (default "llama"). ValueError naming what it asked for and what is supported."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES or name in CLASSIFIERS:
            return name
    if names:
        raise ValueError(f"architecture {' / '.join(map(repr, names))} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    model_type = hf_config.get("model_type", "llama")
    return _by_model_type(model_type, f"model_type {model_type!r} (config.json without `architectures`)")


def gguf_architecture(gguf_name: object, where: str) -> str:
    """The registered architecture of a GGUF file's `general.architecture`; ValueError naming `where`."""
    for name, arch in ARCHITECTURES.items():
        if arch.gguf_name is not None and arch.gguf_name == gguf_name:
            return name
    supported = ", ".join(a.gguf_name for a in ARCHITECTURES.values() if a.gguf_name is not None)
    raise ValueError(f"{where}: architecture {gguf_name!r} is not supported ({supported})")


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The class that runs `cfg`: its `architecture`'s, or (a config built in code without one) its
    model_type's."""
    name = cfg.architecture or _by_model_type(cfg.model_type, f"model_type {cfg.model_type!r}")
    if name in CLASSIFIERS:
        return CLASSIFIERS[name].model_class
    if name not in ARCHITECTURES:
        raise ValueError(f"architecture {name!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name].model_class


def _by_model_type(model_type: str, what: str) -> str:
    for name, arch in ARCHITECTURES.items():
        if arch.model_type == model_type:
            return name
    supported = ", ".join(dict.fromkeys(a.model_type for a in ARCHITECTURES.values()))
    raise ValueError(f"{what} is not supported; supported: {supported} "
                     f"(architectures: {', '.join(ARCHITECTURES)})")
