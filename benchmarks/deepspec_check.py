"""Our DSpark export decoded by DeepSpec's own code: same keys, drafts, tokens and acceptance
lengths (CPU).

    python benchmarks/deepspec_check.py --deepspec /path/to/DeepSpec --drafter runs/demo/drafter \
        [--target FOLDER] [--num-prompts 4] [--max-new-tokens 64]

`--deepspec` is a checkout of github.com/deepseek-ai/DeepSpec (the folder holding `deepspec/`); its
code is imported from there, never copied into this project. The export (a DSpark run's, its config
`Qwen3DSparkModel`) is loaded by DeepSpec's `Qwen3DSparkModel.from_pretrained`: no unexpected or
mismatched key may be reported, and the only missing ones may be its frozen `embed_tokens` and
`lm_head` (our export, like DFlash's, ships neither: the target's are used), which are then set
from the target by DeepSpec's own `initialize_embeddings_and_head`. Each prompt (the demo's
held-out prompts, chat-templated) is decoded at T = 0 twice on the same fp32 target: by DeepSpec's
decoding loop (`generate_decoding_sample` with its DSpark drafting ops,
`forward_dspark_draft_block` and `build_dspark_proposal`, confidence threshold 0: every slot
proposed) and by our reference decoder (eval/speculative.py; the setup, our side and the printed
line are eval/external_check.py). The two must give the same tokens, the same drafts in every round
and the same acceptance lengths (a round whose accepted drafts hold the stop token is counted
without the bonus token by DeepSpec, and its loop may run one round more near the token limit: see
main). Prints one JSON line; exits 1 on any difference.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import DynamicCache

from dflash_async.eval.external_check import (
    Tally,
    check_parser,
    check_setup,
    recorded_decoding,
    reported,
)

# the frozen tensors DeepSpec's model holds and our export leaves to the target
FROZEN = ("embed_tokens.weight", "lm_head.weight")


class AbsoluteCropCache(DynamicCache):
    """DynamicCache whose crop(n >= 0) keeps the first n positions: the transformers 5.10 API
    that DeepSpec pins; later 5.x releases take the number of positions to remove instead."""

    def crop(self, max_length: int) -> None:
        if max_length >= 0:
            max_length = min(0, max_length - self.get_seq_length())
        super().crop(max_length)


def deepspec_modules(root: Path) -> SimpleNamespace:
    """DeepSpec's DSpark model, drafting ops and decoding loop, imported from `root` (its loop's
    caches made AbsoluteCropCache: see there)."""
    if not (root / "deepspec" / "modeling" / "dspark" / "qwen3" / "modeling.py").is_file():
        raise SystemExit(f"error: --deepspec {root}: no deepspec/modeling/dspark/qwen3 there")
    sys.path.insert(0, str(root))
    loop = importlib.import_module("deepspec.eval.base_evaluator")
    loop.DynamicCache = AbsoluteCropCache
    return SimpleNamespace(
        modeling=importlib.import_module("deepspec.modeling.dspark.qwen3.modeling"),
        common=importlib.import_module("deepspec.modeling.dspark.common"),
        ops=importlib.import_module("deepspec.eval.dspark.draft_ops"),
        loop=loop,
    )


def load_deepspec_drafter(ds, export: Path, target):
    """(DeepSpec's Qwen3DSparkModel of the export, its loading info)."""
    model, info = ds.modeling.Qwen3DSparkModel.from_pretrained(
        str(export), dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True
    )
    model.initialize_embeddings_and_head(
        embed_tokens=target.get_input_embeddings(), lm_head=target.get_output_embeddings()
    )
    return model.eval(), {k: sorted(map(str, v)) for k, v in info.items() if k != "error_msgs"}


def deepspec_generate(ds, model, target, prompt: list[int], max_new_tokens: int, eos, log):
    """DeepSpec's T = 0 decoding of one prompt with `model`; each round's drafts go to `log`."""
    block = int(model.block_size)

    def init_context(*, initial_output, **_):
        features = ds.common.extract_context_feature(
            initial_output.hidden_states, model.target_layer_ids
        )
        return SimpleNamespace(cache=AbsoluteCropCache(), features=features)

    def propose(*, context, output_ids, position_ids, start, **_):
        draft_ids = torch.full((1, block), int(model.mask_token_id), dtype=torch.long)
        draft_ids[:, 0] = output_ids[:, start]
        hidden = ds.ops.forward_dspark_draft_block(
            model,
            draft_input_ids=draft_ids,
            position_ids=position_ids,
            past_key_values_draft=context.cache,
            target_hidden_states=context.features,
            start=start,
            block_size=block,
        )
        proposal = ds.ops.build_dspark_proposal(
            model,
            draft_input_ids=draft_ids,
            block_hidden=hidden,
            block_size=block,
            temperature=0.0,
            confidence_threshold=0.0,
        )
        log.append(proposal.verify_input_ids[0, 1:].tolist())
        return proposal

    def update(context, verification):
        features = ds.common.extract_context_feature(
            verification.target_output.hidden_states, model.target_layer_ids
        )
        context.features = features[:, : verification.accepted_draft_tokens + 1]

    return ds.loop.generate_decoding_sample(
        target_model=target,
        input_ids=torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        max_proposal_tokens=block,
        temperature=0.0,
        stop_token_ids=sorted(eos),
        init_context=init_context,
        propose=propose,
        update=update,
    )


def main(argv: list[str] | None = None) -> int:
    args = check_parser(__doc__.splitlines()[0], project="deepspec").parse_args(argv)
    ds = deepspec_modules(args.checkout)
    setup = check_setup(args)
    theirs, info = load_deepspec_drafter(ds, args.drafter, setup.target)
    tally = Tally()
    for i, prompt in enumerate(setup.prompts):
        theirs_log: list = []
        d = deepspec_generate(
            ds, theirs, setup.target, prompt, args.max_new_tokens, setup.eos, theirs_log
        )
        d_tokens = d.output_ids[0, len(prompt) :].tolist()
        spec, ours_log = recorded_decoding(setup, prompt, max_new_tokens=args.max_new_tokens)
        # DeepSpec runs rounds while fewer than max_new_tokens + 1 tokens are out (the first
        # token included), ours while fewer than max_new_tokens: it may run one round more,
        # whose tokens the cut drops. Rounds compared: ours, all but the last in full (the
        # last: by its drafts, DeepSpec counting a stop token's round without its bonus).
        n = len(spec.accepted_lengths)
        same = {
            "tokens": spec.tokens == d_tokens,
            "rounds": n <= len(d.acceptance_lengths) <= n + 1,
            "acceptance_lengths": spec.accepted_lengths[:-1] == list(d.acceptance_lengths)[: n - 1],
            "drafts": ours_log == theirs_log[:n],
        }
        tally.add(i, same, d.acceptance_lengths, rounds=len(theirs_log))
    keys_ok = (
        set(info.get("missing_keys", ())) <= set(FROZEN)
        and not info.get("unexpected_keys")
        and not info.get("mismatched_keys")
    )
    return reported(args, theirs=theirs, info=info, keys_ok=keys_ok, tally=tally)


if __name__ == "__main__":
    raise SystemExit(main())
