"""targets/generic_config.py owns the start-up checks of a target outside the families table (the
generic family, targets/generic.py): what cannot work is refused with one line before any model
loads, everything else transformers builds as a decoder LM is accepted.

Refused: a model_type the installed transformers does not know (its config cannot even be read),
an encoder-decoder, and a config no causal-LM class takes (neither AutoModelForCausalLM nor
AutoModelForImageTextToText, which holds the multimodal wrappers and Mistral 4's text model). A model whose
layers give no hidden states, or that is not causal, is found by the probe at load
(targets/generic.py) and refused there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)


def unknown_model_type(folder: str | Path) -> str | None:
    """None when transformers knows the model_type of `folder`'s config.json (or it has none),
    else one line naming it and the installed version."""
    try:
        model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if model_type is None or model_type in CONFIG_MAPPING_NAMES:
        return None
    return (
        f"target model_type {model_type!r} is not known to the installed transformers "
        f"{transformers.__version__} (a later transformers may know it; remote code is not run)"
    )


def generic_problem(config: Any) -> str | None:
    """None when the generic path can run `config`'s model (see the module doc), else why not."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        return (
            f"target model_type {model_type!r} is an encoder-decoder; drafters are trained for "
            "decoder LMs only"
        )
    text = getattr(config, "text_config", None)
    kinds = {model_type, getattr(text, "model_type", None)}
    if kinds & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return None
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:  # a wrapper, or Mistral 4
        return None
    return (
        f"target model_type {model_type!r} has no causal-LM class in transformers "
        f"{transformers.__version__} (neither AutoModelForCausalLM nor a multimodal wrapper's "
        "language model loads it)"
    )


def text_causal_lm_class(config: Any) -> type | None:
    """The class of the causal LM of the text config `config`: transformers' causal-LM class, or
    for a text model registered only as an image-text-to-text model (Mistral 4's
    Mistral4ForCausalLM) that one; None where there is none (Qwen3-VL's language model)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    found = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if found is None and getattr(config, "text_config", None) is None:  # not a wrapper
        found = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(config), None)
    return found


def causal_lm_auto_class(config: Any) -> type:
    """The auto class that builds `config`'s whole causal LM: AutoModelForCausalLM, or for a
    model_type transformers registers only as an image-text-to-text model (Mistral 4's text
    model, Mistral4ForCausalLM) AutoModelForImageTextToText."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    model_type = getattr(config, "model_type", None)
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type not in (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    ):
        return AutoModelForCausalLM
    return AutoModelForImageTextToText
