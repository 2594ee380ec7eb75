"""Our speculators-convention DSpark export read by vLLM speculators' own classes: same keys, same
block logits and confidence logits as our drafter (CPU, fp32).

    python benchmarks/speculators_check.py --drafter runs/x/drafter-speculators [--target FOLDER]

Needs the `speculators` package importable (it is no dependency of this project: install it in a
separate environment with this project on PYTHONPATH). The export (written by `python -m
dflash_async export --format speculators`) is read twice:
- by speculators: `SpeculatorModelConfig.from_pretrained` must give a `DSparkSpeculatorConfig`
  (its pydantic validation of every field), `DSparkDraftModel(config)` is built from it, and the
  stored tensors must be exactly its state dict's names, less the verifier's that it takes from the
  target (embed_tokens, lm_head, verifier_lm_head, verifier_norm), with equal shapes; those four
  are then set from the target. Where the config's verifier is a local folder, speculators'
  `SpeculatorModel.from_pretrained` must also load the folder with every stored tensor unchanged;
- by us: checkpoint/speculators.py's reader into our DSpark drafter.
One block is then run by both on the same random context features and tokens: speculators'
training forward with one anchor (its `compute_metrics` is wrapped to record the logits and
confidence logits it is handed: their own Markov bias from the gold previous tokens and their own
confidence input), and our one-sequence block drafter (eval/speculative.py) with our Markov and
confidence heads on the same previous tokens. The draft slots compared are those the config
declares (`sample_from_anchor`: all B; otherwise slots 1..B-1). Prints one JSON line; exits 1
unless the keys match and both errors are within the tolerance (see `TOLERANCE`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash_async.checkpoint.speculators import load_speculators_export
from dflash_async.eval.speculative import DFlashBlockDrafter
from dflash_async.model.kinds import kind_of
from dflash_async.targets.loading import frozen_embeddings, load_target
from dflash_async.targets.tiny import ensure_tiny_target

# The tensors speculators takes from the verifier, never from the export.
FROM_VERIFIER = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight")
FROM_VERIFIER += ("verifier_norm.weight",)
# fp32 on both sides, the same weights and inputs, different attention code (eager softmax
# against SDPA) and summation orders: each logit differs by a few ulp of the O(10) values it
# accumulates over d * layers terms, ~1e-6 relative; 1e-4 of the largest |logit| leaves two
# orders of margin, while any wrong slot, head or weight moves logits by O(1) of that scale.
TOLERANCE = 1e-4
CONTEXT, ANCHOR = 24, 11  # context rows of the random sequence, the anchor's position


def speculators_model(folder: Path, target):
    """(speculators' DSparkDraftModel of the export, fp32, eager attention; its key report)."""
    from speculators import SpeculatorModelConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    config = SpeculatorModelConfig.from_pretrained(str(folder))
    if not isinstance(config, DSparkSpeculatorConfig):
        raise SystemExit(f"error: {folder}: read as {type(config).__name__}, not DSpark")
    config.transformer_layer_config._attn_implementation = "eager"
    model = DSparkDraftModel(config).float()
    stored = load_file(str(folder / "model.safetensors"))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    report = {
        "missing": sorted(expected.keys() - stored.keys() - set(FROM_VERIFIER)),
        "unexpected": sorted(stored.keys() - expected.keys()),
        "mismatched": sorted(
            k for k in stored.keys() & expected.keys() if tuple(stored[k].shape) != expected[k]
        ),
        "from_verifier": sorted(expected.keys() & set(FROM_VERIFIER)),
    }
    fits = {k: v for k, v in stored.items() if k in expected and k not in report["mismatched"]}
    model.load_state_dict({k: v.float() for k, v in fits.items()}, strict=False)
    embed, head = frozen_embeddings(target)
    norm = target.get_decoder().norm.weight
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        model.verifier_lm_head.weight.copy_(head)
        model.verifier_norm.weight.copy_(norm)
    return model.eval(), report


def from_pretrained_agrees(folder: Path) -> bool | None:
    """Whether speculators' own loading path, `SpeculatorModel.from_pretrained(folder)` (which
    resolves the model class from the config and reads the verifier's tensors from the folder it
    names), holds every stored tensor unchanged; None when the verifier named is no local folder
    (nothing is downloaded)."""
    from speculators import SpeculatorModel

    verifier = json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]
    if not verifier["name_or_path"] or not Path(verifier["name_or_path"]).is_dir():
        return None
    state = SpeculatorModel.from_pretrained(str(folder)).state_dict()
    stored = load_file(str(folder / "model.safetensors"))
    return all(k in state and torch.equal(state[k], v) for k, v in stored.items())


def their_block(model, features, tokens) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [B, V], confidence logits [B] or None) of the block at ANCHOR, from speculators'
    forward with one anchor (their compute_metrics replaced by a recorder of what it is handed)."""
    from speculators.models.dspark import core

    seen = {}
    original = core.compute_metrics

    def record(logits, targets, confidence_logits, *args, **kwargs):
        seen.update(logits=logits, confidence=confidence_logits)
        return logits.new_zeros(()), {}  # their loss is not compared

    loss_mask = torch.zeros(1, tokens.numel(), dtype=torch.long)
    loss_mask[0, ANCHOR] = 1
    core.compute_metrics = record
    try:
        with torch.no_grad():
            model(
                hidden_states=features[None],
                input_ids=tokens[None],
                loss_mask=loss_mask,
                verifier_last_hidden_states=torch.zeros(1, tokens.numel(), model.hidden_size),
                document_ids=torch.zeros(1, tokens.numel(), dtype=torch.long),
                max_anchors=1,
            )
    finally:
        core.compute_metrics = original
    confidence = seen["confidence"]
    return seen["logits"][0], None if confidence is None else confidence[0]


def our_block(folder: Path, target, features, tokens):
    """(logits [B, V], confidence logits [B] or None) of the block at ANCHOR, from our drafter
    of the export (read back by checkpoint/speculators.py)."""
    config, tensors = load_speculators_export(folder)
    drafter = kind_of(config.kind).make_drafter(config)
    drafter.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    drafter.eval().requires_grad_(False)
    embed, head = frozen_embeddings(target)
    block = DFlashBlockDrafter(drafter, config, embed, head, max_context=CONTEXT)
    width = config.num_features * config.hidden_size
    block.extend_context(features[:ANCHOR, :width], torch.arange(ANCHOR))
    hidden = block.block_hidden(int(tokens[ANCHOR]), ANCHOR)  # [B, d], every slot drafts
    previous = tokens[ANCHOR : ANCHOR + config.block_size]  # slot k's: the token at anchor + k
    with torch.no_grad():
        logits = drafter.draft_logits(hidden, previous, head)
        return logits, drafter.confidence_logits(hidden, previous)


def max_error(ours: torch.Tensor | None, theirs: torch.Tensor | None) -> float | None:
    """max |ours - theirs|; None where either is missing or their shapes differ."""
    if ours is None or theirs is None or ours.shape != theirs.shape:
        return None
    return (ours - theirs).abs().max().item()


def compare(ours_folder: Path, theirs_folder: Path, target, *, seed: int = 0) -> dict:
    """The check's result (see the module doc): ours read from `ours_folder`, theirs from
    `theirs_folder` (the same export, except in the tests' purpose-made mutants)."""
    model, report = speculators_model(theirs_folder, target)
    generator = torch.Generator().manual_seed(seed)
    k = len(model.config.aux_hidden_state_layer_ids)
    features = torch.randn(CONTEXT, k * model.hidden_size, generator=generator)
    tokens = torch.randint(0, model.verifier_vocab_size, (CONTEXT,), generator=generator)
    theirs, their_confidence = their_block(model, features, tokens)
    ours, our_confidence = our_block(ours_folder, target, features, tokens)
    if not model.config.sample_from_anchor:  # the B+1 convention: slot 0 drafts nothing
        theirs = theirs[1:]
        their_confidence = None if their_confidence is None else their_confidence[1:]
    scale = ours.abs().max().item()
    logit_error = max_error(ours, theirs)
    confidence_error = max_error(our_confidence, their_confidence)
    result = {
        "speculators_config": type(model.config).__name__,
        **report,
        "from_pretrained_agrees": from_pretrained_agrees(theirs_folder),
        "slots": [ours.shape[0], theirs.shape[0]],
        "logit_scale": scale,
        "max_logit_error": logit_error,
        "max_confidence_error": confidence_error,
    }
    keys_ok = not (report["missing"] or report["unexpected"] or report["mismatched"])
    logits_ok = logit_error is not None and logit_error <= TOLERANCE * scale
    if our_confidence is None or their_confidence is None:
        confidence_ok = our_confidence is None and their_confidence is None
    else:
        bound = TOLERANCE * max(1.0, our_confidence.abs().max().item())
        confidence_ok = confidence_error is not None and confidence_error <= bound
    loaded_ok = result["from_pretrained_agrees"] is not False
    result["ok"] = bool(keys_ok and loaded_ok and logits_ok and confidence_ok)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--target", default="", help="empty: the tiny demo target")
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache/dflash_async"))
    args = parser.parse_args(argv)
    folder = Path(args.target) if args.target else ensure_tiny_target(args.cache_dir)
    target = load_target(folder, device="cpu", dtype=torch.float32)
    result = compare(args.drafter, args.drafter, target)
    print(json.dumps({"drafter": str(args.drafter), **result}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
