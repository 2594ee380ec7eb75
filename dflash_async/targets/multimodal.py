"""The multimodal target forward: a wrapper (`*ForConditionalGeneration`: vision tower, merger,
language model) run whole by its own HF forward on image+text packs, one document at a time;
and the choice of the image+text path (`multimodal_path`): the packed one where the wrapper has
it (targets/packed/image_text.py, checked against this one), else this one.

Exact by construction, as the generic path (targets/generic.py) is for text: each document runs
alone and unpadded with its own vision inputs (data/images.py), so the wrapper computes that
document's image embeddings and its own multimodal RoPE positions (Qwen3-VL's 3-D positions
from `get_rope_index`: a document's text after an image continues from the image's largest
position, not from its token count) and Gemma 3's bidirectional attention inside each image,
and nothing of another document reaches it. The features are the raw outputs of the language
model's tapped decoder layers as they enter the next layer (Qwen3-VL adds its deepstack visual
features to the first layers' outputs at image positions: they are in), image positions
included; padding rows are zero.

Loading for image data (`load_multimodal_target`, `load_target_processor`) takes the wrapper
whole, tower included, and the target folder's processor; text runs keep loading the language
model alone (targets/loading.py).

The drafter keeps its plain 1-D positions (`PackedBatch.position_ids`, restarting at 0 in every
document): the multimodal positions are the target's alone.

Decoding an image prompt runs the wrapper on the prompt and the tokens generated after it
(eval/recompute.py). A generated token is text whatever its id, as in HF's `generate` (whose
steps after the prompt carry no vision inputs) and in serving engines (which place features at
the prompt's placeholders only): `generated_as_text` hides generated ids the wrapper would read
as an image's placeholders or markers (`multimodal_token_ids`) from everything but the embedding.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from dflash_async.data.packing import pack_row_offsets
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.generic import GenericForward, find_decoder_layers, layer_input
from dflash_async.targets.hf_load import offline_torch_modules
from dflash_async.targets.loading import NON_TEXT_PARTS
from dflash_async.targets.packed.image_text import PackedImageTextForward
from dflash_async.targets.packed.image_text_gemma3 import PackedGemma3ImageTextForward
from dflash_async.targets.paths import TargetPath
from dflash_async.targets.resolve import TargetError


def language_model_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a wrapper's language model (never the vision tower's blocks, which
    may be as many)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = find_decoder_layers(decoder) if decoder is not None else None
    if layers is None:
        raise TargetError(f"{type(model).__name__}: no language model decoder layers found")
    return layers


class MultimodalForward:
    """The FeatureForward of image+text packs (see the module doc).

    Called as the text paths are, plus `vision`: one mapping of the model's vision inputs per
    document of the pack, in pack order, on the target device (ImageTextSample.model_inputs;
    an empty mapping for a text-only document; None: all text).
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]) -> None:
        problem = model_vision_problem(model)
        if problem:
            raise TargetError(problem)
        layers = language_model_layers(model)
        self.generic = GenericForward(model, layer_ids, max_batch_tokens=1, layers=layers)
        self.model = model
        self._handles = [
            layers[i + 1].register_forward_pre_hook(self._entering(slot), with_kwargs=True)
            for slot, i in enumerate(self.generic.layer_ids)
            if i + 1 < len(layers)
        ]

    def _entering(self, slot: int):
        """A pre-hook of the layer after tapped layer `slot`: the hidden state entering it
        replaces the tapped layer's output, so what the wrapper adds between the two (Qwen3-VL's
        deepstack visual features, after its first layers, at image positions) is in the
        features, as SGLang's DFlash capture reads them (the hidden state entering the next
        layer). Equal to the output where nothing is added."""
        d = self.generic.hidden_size

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            out = self.generic._out
            hidden = layer_input(args, kwargs)
            if out is None or not isinstance(hidden, torch.Tensor):
                return
            if hidden.shape == (*out.shape[:2], d):
                out[..., slot * d : (slot + 1) * d].copy_(hidden)

        return hook

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor,
        features: torch.Tensor,
        lengths: Any,
        vision: Sequence[Mapping[str, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        lengths = np.asarray(lengths, dtype=np.int64)
        vision = [{}] * len(lengths) if vision is None else vision  # text documents
        if len(vision) != len(lengths):
            raise ValueError(f"{len(vision)} vision inputs for {len(lengths)} documents")
        offsets = pack_row_offsets(lengths)
        for r, n in enumerate(lengths.tolist()):
            lo = int(offsets[r])
            ids = input_ids[lo : lo + n][None]  # [1, n]
            features[lo : lo + n] = self.generic.features(ids, **vision[r])[0]
        features[int(offsets[-1]) :] = 0  # padding rows (finite: masked keys still multiply V)
        return features

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.generic.close()


# model_type -> the packed image+text forward of that wrapper (the vision inputs it reads and the
# methods of `model.model` it calls are that wrapper's); every other wrapper runs
# MultimodalForward.
PACKED_WRAPPERS = {
    "qwen3_vl": PackedImageTextForward,
    "qwen3_vl_moe": PackedImageTextForward,
    "qwen3_5": PackedImageTextForward,
    "qwen3_5_moe": PackedImageTextForward,
    "gemma3": PackedGemma3ImageTextForward,
}


def multimodal_path(
    model: nn.Module,
    layer_ids: Sequence[int],
    *,
    token_budget: int,
    packed: bool = True,
    packed_hybrid: bool = True,
) -> TargetPath:
    """The TargetPath of image+text packs: the whole pack in one packed pass where the wrapper
    has one over its language model's packed forward (`packed_image_text`,
    targets/packed/image_text.py), else MultimodalForward (`hf_multimodal`), the reason saying
    why. `packed=False`: MultimodalForward always (the reference); `packed_hybrid`: as
    select_target_forward's (DFLASH_TARGET__PACKED_HYBRID)."""
    model_type = model.config.model_type
    forward = PACKED_WRAPPERS.get(model_type)
    problem = "packed=False" if not packed else None
    if problem is None and forward is None:
        problem = f"{model_type!r} has no packed image+text forward"
    if problem is None:  # the language model's packed forward, as for its text packs
        text = select_target_forward(
            model,
            layer_ids,
            token_budget=token_budget,
            max_batch_tokens=token_budget,
            packed_hybrid=packed_hybrid,
        )
        inner = getattr(text.forward, "packed", text.forward)  # PackedCall's, or the hybrid
        why = forward.problem(inner)
        problem = f"{model_type!r}: {why}" if why else None
    if problem is None:
        return TargetPath(
            forward(model, inner),
            "packed_image_text",
            f"image+text data: {forward.summary}, then {text.name} ({text.reason})",
        )
    return TargetPath(
        MultimodalForward(model, layer_ids),
        "hf_multimodal",
        f"image+text data: the wrapper's HF forward per document with its vision inputs "
        f"({problem})",
    )


# The wrapper-config fields (a transformers convention; Gemma 3's image_token_index answers to
# image_token_id) naming tokens whose meaning the wrapper's forward reads from the ids: the
# placeholders its vision or audio inputs' features replace, and the markers around them from
# which some wrappers count images for their positions.
MULTIMODAL_TOKEN_FIELDS = (
    "image_token_id",
    "video_token_id",
    "audio_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "image_start_token_id",
    "image_end_token_id",
    "video_start_token_id",
    "video_end_token_id",
    "audio_start_token_id",
    "audio_end_token_id",
    "boi_token_id",
    "eoi_token_id",
)


def multimodal_token_ids(config: Any) -> frozenset[int]:
    """The ids a wrapper `config` names in MULTIMODAL_TOKEN_FIELDS (none for a text config)."""
    ids = (getattr(config, name, None) for name in MULTIMODAL_TOKEN_FIELDS)
    return frozenset(int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool))


@contextmanager
def generated_as_text(
    model: nn.Module, ids: torch.Tensor, prompt_length: int
) -> Iterator[torch.Tensor]:
    """The ids [1, n] (a prompt of `prompt_length` tokens, then generated ones) to give the
    wrapper `model`'s forward inside this context: generated multimodal tokens
    (multimodal_token_ids) become a stand-in id, so that no placeholder mask, image count or
    position rule sees them, while the input embedding module's output on those ids is that of
    the real `ids`: every generated token is a text token with its own embedding. RuntimeError
    if the forward never embedded the ids (a wrapper embedding its input some other way)."""
    special = multimodal_token_ids(model.config)
    if not special:
        yield ids
        return
    stand_in = min(set(range(len(special) + 1)) - special)  # any id the wrapper reads as text
    shown = ids.clone()
    generated = shown[:, prompt_length:]
    generated.masked_fill_(
        torch.isin(generated, torch.tensor(sorted(special), device=ids.device)), stand_in
    )
    embedded: list[bool] = []

    def embed_real_ids(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if args and args[0].shape == shown.shape and torch.equal(args[0], shown):
            embedded.append(True)
            return module.forward(ids)
        return output

    handle = model.get_input_embeddings().register_forward_hook(embed_real_ids)
    try:
        yield shown
    finally:
        handle.remove()
    if not embedded:
        raise RuntimeError(f"{type(model).__name__}'s forward did not embed its input_ids")


def vision_problem(config: Any) -> str | None:
    """None when the target config has a vision tower (a `vision_config`), else why image data
    cannot train on it."""
    if getattr(config, "vision_config", None) is not None:
        return None
    return (
        f"target model_type {getattr(config, 'model_type', None)!r} has no vision tower: image "
        "records need a multimodal target (its *ForConditionalGeneration checkpoint)"
    )


def model_vision_problem(model: nn.Module) -> str | None:
    """None when the loaded `model` holds its vision tower, else why it cannot read images (a
    text model, or a wrapper loaded for text data, whose tower was left out: targets/loading.py)."""
    problem = vision_problem(model.config)
    if problem:
        return problem
    inner = getattr(model, "model", model)
    if not any(getattr(inner, name, None) is not None for name in NON_TEXT_PARTS):
        return f"{type(model).__name__} was loaded without its vision tower (for text data)"
    return None


def load_target_processor(path: str) -> Any:
    """The target folder's processor (transformers' AutoProcessor, local files only): what
    turns image records into tokens and pixel inputs; TargetError if it cannot load."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, ImportError, AttributeError) as e:
        raise TargetError(f"cannot load the processor of target {str(path)!r}: {e}") from e
    if getattr(processor, "image_processor", None) is None:
        raise TargetError(f"target {str(path)!r} has no image processor: image data needs one")
    return processor


def load_multimodal_target(path: str, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The whole wrapper (vision tower, merger, language model) in `dtype` on `device`, in eval
    mode; TargetError if it cannot load."""
    from transformers import AutoModelForImageTextToText

    try:
        model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=dtype, **offline_torch_modules()
        )
    except (OSError, ValueError, KeyError) as e:
        raise TargetError(f"cannot load target {str(path)!r} with its vision tower: {e}") from e
    return model.to(device).eval().requires_grad_(False)
