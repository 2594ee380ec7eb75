"""Image+text records -> per-sample token ids, assistant-only loss masks and vision inputs.

A record is an OpenAI conversation whose message content is a list of parts:
  {"type": "text", "text": ...}
  {"type": "image_url", "image_url": {"url": U}}  or  {"type": "image", "image": U}
where U is a path (relative to the data file's folder, or absolute), a `file://` URL or a base64
`data:image/...;base64,` URL; or a ShareGPT/LLaVA conversation whose values hold `<image>`
placeholders, with the record's `image` (one) or `images` (a list) naming the files in order.

The target's own processor (transformers' `AutoProcessor` of the target: Qwen3-VL's, Gemma 3's)
does the rest: its chat template renders each image part as the model's placeholder, and its
call expands every placeholder into the image's tokens and computes the pixel inputs. The loss
mask is the text path's (data/chat.py: assistant-generated characters), carried through the
expansion by the processor's replacement offsets: an image token is never supervised, nor is
anything a user or system turn holds.
"""

from __future__ import annotations

import base64
import io
import re
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_async.data.chat import assistant_char_mask, supervised_turns, token_mask
from dflash_async.data.formats import (
    DEFAULT_ROLE_MAP,
    EXTRA_MESSAGE_KEYS,
    ROLES,
    BadRecord,
    DataError,
    iter_raw_records,
    parse_record,
    parse_role_map,
    resolve_files,
)
from dflash_async.data.rendering import render_chat
from dflash_async.data.samples import TokenizedSamples

IMAGE_DROP_REASONS = ("bad_record", "no_assistant_turn", "too_few_supervised", "too_long_dropped")
SHAREGPT_IMAGE = "<image>"  # the LLaVA/ShareGPT placeholder of one image in a turn's text
SCANNED_RECORDS = 256  # records of each file data_has_images looks at
# The processor's outputs that are not vision inputs of the model's forward.
TEXT_OUTPUTS = ("input_ids", "attention_mask", "offset_mapping", "text_replacement_offsets")


@dataclass(frozen=True, eq=False)
class ImageTextSample:
    """One conversation with its images, as the target reads it.

    input_ids [L] int32 with every image placeholder expanded to the image's tokens; loss_mask
    [L] bool (assistant text only); vision: the processor's other outputs for this document
    alone, batch dimension dropped where it has one (Qwen3-VL: pixel_values [patches, dim],
    image_grid_thw [images, 3], mm_token_type_ids [L]; Gemma 3: pixel_values [images, 3, H, W],
    token_type_ids [L]), passed to the wrapper's forward as they are. text: the rendering the
    processor expanded; sources: the images' resolved paths or data URLs (read_image_samples),
    from which the vision inputs can be computed again (ImageTextSamples keeps only these).
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    vision: dict[str, torch.Tensor] = field(default_factory=dict)
    num_images: int = 0
    text: str = ""
    sources: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.input_ids)

    def image_tokens(self) -> np.ndarray:
        """[L] bool: the tokens an image's features replace (a nonzero per-token type)."""
        types = [v for name, v in self.vision.items() if _per_token(name)]
        if not types:
            return np.zeros(len(self.input_ids), dtype=bool)
        return types[0].numpy() != 0

    def model_inputs(self, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The vision inputs for a batch of this one document on `device` (floats in `dtype`)."""
        out = {}
        for name, value in self.vision.items():
            value = value.to(device, dtype) if value.is_floating_point() else value.to(device)
            out[name] = value[None] if _per_token(name) else value
        return out


def _per_token(name: str) -> bool:
    """Outputs with one entry per token, batched as [1, L]; the rest are per image or patch."""
    return name.endswith("token_type_ids")


def extended_inputs(inputs: Mapping[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """A document's model inputs (ImageTextSample.model_inputs) for the document continued by
    text to `length` tokens: per-token entries padded with 0 (a text token's type); the rest,
    per image or patch, as they are."""
    out = dict(inputs)
    for name, value in inputs.items():
        if _per_token(name) and value.shape[-1] < length:
            pad = value.new_zeros(*value.shape[:-1], length - value.shape[-1])
            out[name] = torch.cat([value, pad], dim=-1)
    return out


@dataclass(frozen=True, eq=False)
class ImageTextSamples(TokenizedSamples):
    """Image+text samples in the text samples' flat layout (what the planner and the target
    stage read: tokens, loss_mask, offsets, lengths), each with its vision inputs.

    Pixel inputs are large (a 448x448 image is ~4.8 MB of fp32 patches for Qwen3-VL), so with a
    `processor` only each sample's rendering and image sources are kept, and `model_inputs`
    runs the processor again for the pack being staged (its token ids checked against the
    sample's); without one the samples' vision inputs are held as they are (tests, a few
    samples).
    """

    vision: tuple[dict[str, torch.Tensor], ...] = ()
    texts: tuple[str, ...] = ()
    sources: tuple[tuple[str, ...], ...] = ()
    processor: Any = None

    @classmethod
    def of(
        cls,
        samples: Sequence[ImageTextSample],
        summary: Mapping | None = None,
        *,
        processor: Any = None,
    ) -> ImageTextSamples:
        lengths = np.array([len(s) for s in samples], dtype=np.int64)
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        empty = np.zeros(0, dtype=np.int32)
        lazy = processor is not None
        return cls(
            tokens=np.concatenate([s.input_ids for s in samples]) if samples else empty,
            loss_mask=np.concatenate([s.loss_mask for s in samples]) if samples else empty > 0,
            offsets=offsets,
            summary=dict(summary or {}),
            vision=() if lazy else tuple(s.vision for s in samples),
            texts=tuple(s.text for s in samples) if lazy else (),
            sources=tuple(s.sources for s in samples) if lazy else (),
            processor=processor,
        )

    def model_inputs(self, i: int, device: torch.device, dtype: torch.dtype) -> dict:
        """Sample i's vision inputs for its forward alone (ImageTextSample.model_inputs)."""
        ids, mask = self.sample(i)
        if self.processor is None:
            vision = self.vision[i]
        else:
            vision = vision_inputs(self.processor, self.texts[i], self.sources[i], ids)
        return ImageTextSample(ids, mask, vision).model_inputs(device, dtype)


def vision_inputs(
    processor: Any, text: str, sources: Sequence[str], input_ids: np.ndarray
) -> dict[str, torch.Tensor]:
    """The vision inputs of a read sample, computed again from its rendering and image sources;
    ValueError if the processor's token ids are no longer the sample's (an image changed size
    on disk since the data was read)."""
    images = [load_image(source, None) for source in sources]
    out = processor(text=[text], images=images or None, add_special_tokens=False)
    if not np.array_equal(np.asarray(out["input_ids"][0]), input_ids):
        raise ValueError(f"the images {list(sources)} no longer give the tokens read from them")
    return {
        name: _unbatched(name, value) for name, value in out.items() if name not in TEXT_OUTPUTS
    }


def has_images(record: Mapping) -> bool:
    """Whether a parsed record holds an image part or names images (ShareGPT)."""
    if record.get("image") is not None or record.get("images"):
        return True
    turns = record.get("messages") or []
    return any(
        isinstance(turn, dict)
        and isinstance(turn.get("content"), list)
        and any(
            isinstance(p, dict) and p.get("type") in ("image", "image_url") for p in turn["content"]
        )
        for turn in turns
    )


def resolve_image(ref: Any, root: Path | None) -> str:
    """An image reference as a source load_image opens from anywhere: a base64 data URL as it
    is, a path (relative to `root`) or file:// URL as an absolute path that exists; BadRecord
    naming it otherwise."""
    if not isinstance(ref, str) or not ref:
        raise BadRecord(f"an image must be a path or URL string, got {type(ref).__name__}")
    if ref.startswith("data:"):
        head = ref.partition(",")[0]
        if not head.endswith(";base64"):
            raise BadRecord(f"image data URL {head[:40]!r} is not base64")
        return ref
    if re.match(r"^[a-z]+://", ref) and not ref.startswith("file://"):
        raise BadRecord(f"image {ref!r}: only local paths, file:// and data: URLs are read")
    path = Path(ref.removeprefix("file://"))
    if not path.is_absolute() and root is not None:
        path = root / path
    if not path.is_file():
        raise BadRecord(f"image file {str(path)!r} does not exist")
    return str(path.resolve())


def load_image(ref: Any, root: Path | None) -> Any:
    """A PIL RGB image from a path (relative to `root`), a file:// URL or a base64 data URL;
    BadRecord naming it if it is missing or unreadable."""
    from PIL import Image, UnidentifiedImageError

    source = resolve_image(ref, root)
    if source.startswith("data:"):
        try:
            stream: Any = io.BytesIO(base64.b64decode(source.partition(",")[2], validate=True))
        except ValueError as exc:
            raise BadRecord(f"image data URL is not valid base64: {exc}") from exc
        name = "data URL"
    else:
        stream, name = source, source
    try:
        with Image.open(stream) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise BadRecord(f"image {name!r} is not a readable image: {exc}") from exc


def image_conversation(
    record: Mapping, *, root: Path | None, role_map: Mapping[str, str] = DEFAULT_ROLE_MAP
) -> tuple[list[dict], list[str]]:
    """(messages, sources) of an image+text record: messages in the chat templates' convention
    (a content with images is a list of {"type": "image"} and {"type": "text", "text"} parts;
    one without stays a string), the images' sources (resolve_image) in the order their parts
    appear."""
    if record.get("messages") is not None:
        turns, role_key, content_key, named = record["messages"], "role", "content", None
    elif record.get("conversations") is not None:
        turns, role_key, content_key = record["conversations"], "from", "value"
        named = record.get("images", record.get("image"))
        named = [named] if isinstance(named, str) else list(named or [])
    else:
        raise BadRecord("an image record needs 'messages' or 'conversations'")
    if not isinstance(turns, list):
        raise BadRecord(f"{role_key!r} turns must be a list, got {type(turns).__name__}")
    messages, refs = [], []
    for n, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRecord(f"message {n} must be an object, got {type(turn).__name__}")
        name = turn.get(role_key)
        role = (name if name in ROLES else role_map.get(name)) if isinstance(name, str) else None
        if role is None:
            raise BadRecord(f"message {n} has unknown role {role_key}={name!r}")
        message = {k: turn[k] for k in EXTRA_MESSAGE_KEYS if turn.get(k) is not None}
        message["role"] = role
        parts = _parts(turn.get(content_key), n, refs, sharegpt=named is not None)
        if parts is not None:
            if any(p["type"] == "image" for p in parts):
                if role == "assistant":
                    raise BadRecord(f"message {n}: images in assistant turns are not supported")
                message["content"] = parts
            else:
                message["content"] = "".join(p["text"] for p in parts)
        messages.append(message)
    if named is not None:
        if len(named) != len(refs):
            raise BadRecord(
                f"{len(refs)} {SHAREGPT_IMAGE} placeholders but {len(named)} images named"
            )
        refs = named
    return messages, [resolve_image(ref, root) for ref in refs]


def _parts(content: Any, n: int, refs: list, *, sharegpt: bool) -> list[dict] | None:
    """A turn's content as template parts; image references appended to `refs`."""
    if content is None:
        return None
    if isinstance(content, str):
        if not sharegpt:
            return [{"type": "text", "text": content}]
        pieces = content.split(SHAREGPT_IMAGE)
        parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
        for piece in pieces[1:]:
            refs.append(None)  # the record's images name them, in order
            parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        return parts
    if not isinstance(content, list):
        raise BadRecord(f"message {n} content must be text or parts, got {type(content).__name__}")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            refs.append(url.get("url") if isinstance(url, dict) else url)
            parts.append({"type": "image"})
        elif kind == "image":
            refs.append(part.get("image", part.get("url", part.get("path"))))
            parts.append({"type": "image"})
        else:
            raise BadRecord(f"message {n} has a content part of unknown type {kind!r}")
    return parts


def openai_image_messages(
    record: Mapping, *, root: Path | None, role_map: Mapping[str, str] = DEFAULT_ROLE_MAP
) -> list[dict]:
    """An image+text record's conversation as OpenAI messages: image parts as
    {"type": "image_url", "image_url": {"url": source}} with each source resolved (an absolute
    path or a data URL: resolve_image), text parts as they are; what `run` reads back."""
    messages, sources = image_conversation(record, root=root, role_map=role_map)
    remaining = iter(sources)
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = [
                {"type": "image_url", "image_url": {"url": next(remaining)}}
                if part["type"] == "image"
                else part
                for part in content
            ]
            message = {**message, "content": parts}
        out.append(message)
    return out


def inline_images(messages: Sequence[dict]) -> list[dict]:
    """OpenAI messages with every local image (an absolute path) as a base64 data URL, for a
    server that cannot read this machine's files; BadRecord naming an unreadable one."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [_inlined(part) for part in content]
            message = {**message, "content": content}
        out.append(message)
    return out


def _inlined(part: Any) -> Any:
    if not (isinstance(part, dict) and part.get("type") == "image_url"):
        return part
    url = part["image_url"]["url"]
    if url.startswith("data:"):
        return part
    try:
        data = Path(url).read_bytes()
    except OSError as exc:
        raise BadRecord(f"image file {url!r} cannot be read: {exc}") from exc
    kind = (Path(url).suffix.lstrip(".").lower() or "png").replace("jpg", "jpeg")
    encoded = base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/{kind};base64,{encoded}"}}


def processor_template(processor: Any) -> str:
    """The processor's chat template (the one that renders image parts), else its tokenizer's."""
    template = getattr(processor, "chat_template", None) or getattr(
        processor.tokenizer, "chat_template", None
    )
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise DataError("the target's processor has no chat template; image data needs one")
    return template


def encode_image_chat(
    processor: Any,
    messages: Sequence[dict],
    images: Sequence[Any],
    *,
    enable_thinking: bool,
    loss_turns: str = "all",
) -> ImageTextSample:
    """The conversation's expanded token ids, loss mask and vision inputs (see the module doc)."""
    text, char_mask = assistant_char_mask(
        processor_template(processor),
        messages,
        enable_thinking=enable_thinking,
        loss_turns=loss_turns,
    )
    out = processor(
        text=[text],
        images=list(images) or None,
        return_text_replacement_offsets=True,
        return_offsets_mapping=True,
        add_special_tokens=False,
    )
    replacements = out["text_replacement_offsets"][0] if images else []
    if len(replacements) != len(images):
        raise BadRecord(
            f"{len(images)} images but the chat template rendered {len(replacements)} "
            "image placeholders"
        )
    expanded = _expanded_mask(char_mask, replacements)
    ids = np.asarray(out["input_ids"][0], dtype=np.int32)
    mask = token_mask(expanded, out["offset_mapping"][0])
    vision = {
        name: _unbatched(name, value) for name, value in out.items() if name not in TEXT_OUTPUTS
    }
    return ImageTextSample(ids, mask, vision, num_images=len(images), text=text)


def encode_image_prompt(
    processor: Any, messages: Sequence[dict], images: Sequence[Any], *, enable_thinking: bool
) -> ImageTextSample:
    """A prompt (the conversation so far, rendered with the generation prompt) with its images:
    expanded token ids, an all-False loss mask and the vision inputs (what decoding starts
    from)."""
    text = render_chat(
        processor_template(processor),
        messages,
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
    )
    return encode_rendered_prompt(processor, text, images)


def encode_rendered_prompt(processor: Any, text: str, images: Sequence[Any]) -> ImageTextSample:
    """A prompt already rendered by a chat template, with its images, as encode_image_prompt
    gives it."""
    out = processor(text=[text], images=list(images) or None, add_special_tokens=False)
    ids = np.asarray(out["input_ids"][0], dtype=np.int32)
    vision = {
        name: _unbatched(name, value) for name, value in out.items() if name not in TEXT_OUTPUTS
    }
    return ImageTextSample(ids, np.zeros(len(ids), dtype=bool), vision, num_images=len(images))


def _unbatched(name: str, value: Any) -> torch.Tensor:
    value = torch.as_tensor(np.asarray(value))
    return value[0] if _per_token(name) else value


def _expanded_mask(char_mask: np.ndarray, replacements: Sequence[Mapping]) -> np.ndarray:
    """The character mask of the expanded text: each replaced placeholder span becomes its
    expansion, unsupervised; the text around it keeps its mask."""
    pieces, at = [], 0
    for item in sorted(replacements, key=lambda r: r["span"][0]):
        start, end = item["span"]
        new_start, new_end = item["new_span"]
        pieces.append(char_mask[at:start])
        pieces.append(np.zeros(new_end - new_start, dtype=bool))
        at = end
    pieces.append(char_mask[at:])
    return np.concatenate(pieces) if pieces else char_mask


def read_image_samples(
    path: str,
    processor: Any,
    *,
    max_len: int,
    block_size: int,
    enable_thinking: bool = True,
    loss_turns: str = "all",
    on_bad_record: str = "error",
    role_map: Mapping[str, str] = DEFAULT_ROLE_MAP,
    keep_vision: bool = True,
) -> tuple[list[ImageTextSample], Counter]:
    """Every usable image+text sample of the data at `path`, in file order, and the counts.

    Filters as the text path does (no assistant turn, fewer than 2 x block_size supervised
    tokens); a sample longer than max_len is dropped (truncating one would cut an image's
    tokens off its pixels). A bad record (a missing or unreadable image among them) is a
    DataError naming its file and line, or with on_bad_record="skip" a counted skip.
    keep_vision=False drops each sample's vision inputs once read (ImageTextSamples computes
    them again from the sample's text and sources).
    """
    samples, counts = [], Counter()
    for file in resolve_files(path):
        for where, raw in iter_raw_records(file):
            counts["records"] += 1
            try:
                record = parse_record(raw)
                messages, sources = image_conversation(record, root=file.parent, role_map=role_map)
                if not supervised_turns(messages, loss_turns):
                    counts["no_assistant_turn"] += 1
                    continue
                sample = encode_image_chat(
                    processor,
                    messages,
                    [load_image(source, None) for source in sources],
                    enable_thinking=enable_thinking,
                    loss_turns=loss_turns,
                )
                kept = sample.vision if keep_vision else {}
                sample = replace(sample, sources=tuple(sources), vision=kept)
            except (BadRecord, ValueError) as exc:
                if on_bad_record == "error":
                    raise DataError(f"{where}: {exc}") from exc
                counts["bad_record"] += 1
                continue
            if len(sample) > max_len:
                counts["too_long_dropped"] += 1
            elif int(sample.loss_mask.sum()) < 2 * block_size:
                counts["too_few_supervised"] += 1
            else:
                samples.append(sample)
                counts["images"] += sample.num_images
    return samples, counts


def data_has_images(path: str, *, per_file: int = SCANNED_RECORDS) -> bool:
    """Whether the data at `path` holds image records: any of the first `per_file` records of
    any file (has_images; a file's records are one kind, as data sets are built). A JSON line is
    parsed only when its bytes mention "image"; the scan stops at the first image record, and a
    large text corpus costs the first records of each file, not a pass over it."""
    for file in resolve_files(path):
        for n, (_, raw) in enumerate(iter_raw_records(file)):
            if n == per_file:
                break
            if isinstance(raw, bytes) and b"image" not in raw:
                continue
            try:
                if has_images(parse_record(raw)):
                    return True
            except BadRecord:
                continue  # reported by the reader that meets it
    return False


def load_image_samples(
    path: str, processor: Any, *, options: Any, block_size: int, log: Any
) -> ImageTextSamples:
    """The read stage's image+text samples (read_image_samples under the `data` settings,
    data/samples.DataOptions), in memory, logged once as `data_loaded` with the image count;
    DataError when none is usable."""
    started = time.perf_counter()
    samples, counts = read_image_samples(
        path,
        processor,
        keep_vision=False,
        max_len=options.max_len,
        block_size=block_size,
        enable_thinking=options.enable_thinking,
        loss_turns=options.loss_turns,
        on_bad_record=options.on_bad_record,
        role_map=parse_role_map(options.role_map),
    )
    summary = {
        "files": len(resolve_files(path)),
        "records": counts["records"],
        "samples": len(samples),
        "images": counts["images"],
        **{reason: counts[reason] for reason in IMAGE_DROP_REASONS},
        "tokens": int(sum(len(s) for s in samples)),
        "supervised_tokens": int(sum(int(s.loss_mask.sum()) for s in samples)),
        "max_token_id": int(max((int(s.input_ids.max()) for s in samples), default=-1)),
    }
    if not samples:
        counted = ", ".join(f"{k}={v}" for k, v in summary.items() if v and k != "max_token_id")
        raise DataError(f"{path}: no usable image+text samples after filtering ({counted})")
    log.info(
        "data_loaded",
        path=path,
        cached=False,
        load_s=round(time.perf_counter() - started, 3),
        **summary,
    )
    return ImageTextSamples.of(samples, summary, processor=processor)
