"""Our export decoded by z-lab's own code: same keys, drafts, tokens and acceptance lengths (CPU).

    python benchmarks/zlab_check.py --zlab /path/to/z-lab/dflash --drafter runs/demo/drafter \
        [--target FOLDER] [--num-prompts 4] [--max-new-tokens 64]

`--zlab` is a checkout of github.com/z-lab/dflash (the folder holding `dflash/model.py`); its code
is imported from there, never copied into this project. The export is loaded by z-lab's
`DFlashDraftModel` or `DFlash2DraftModel` (by its `architectures`) with `from_pretrained`, which
must report no missing, unexpected or mismatched keys. Each prompt (the demo's held-out prompts,
chat-templated) is then decoded greedily twice on the same fp32 target: by z-lab's
`dflash_generate` and by our reference decoder (eval/speculative.py; the setup, our side and the
printed line are eval/external_check.py), with the target's stop token and no suppressed tokens
(z-lab suppresses none). The two must give the same tokens, the same acceptance lengths (ours cut
at the stop or the token limit as z-lab counts them) and the same drafts in every full-block round
(near the token limit z-lab drafts a shorter block, whose slots attend to fewer block rows and so
differ: those rounds compare acceptance only). Prints one JSON line; exits 1 on any difference. (On
a machine without CUDA, z-lab's stats timer, which synchronizes CUDA, is pointed at
time.perf_counter.)
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

import torch

from dflash_async.eval.external_check import (
    Tally,
    check_parser,
    check_setup,
    recorded_decoding,
    reported,
)


def zlab_model_module(root: Path):
    """z-lab's `dflash.model`, imported from the checkout at `root`."""
    if not (root / "dflash" / "model.py").is_file():
        raise SystemExit(f"error: --zlab {root}: no dflash/model.py there")
    sys.path.insert(0, str(root))
    module = importlib.import_module("dflash.model")
    if not torch.cuda.is_available():  # its stats timer calls torch.cuda.synchronize()
        module._cuda_time = time.perf_counter
    return module


def load_zlab_drafter(zlab, export: Path):
    """(z-lab's model of the export's architecture, its loading info)."""
    config = json.loads((export / "config.json").read_text())
    cls = getattr(zlab, config["architectures"][0])
    model, info = cls.from_pretrained(str(export), dtype=torch.float32, output_loading_info=True)
    return model.eval(), {k: sorted(map(str, v)) for k, v in info.items() if k != "error_msgs"}


def recorded_zlab_drafts(zlab, model, log: list) -> None:
    """Wrap the z-lab model's draft step (the selector walk, or the unary logits' argmax) so that
    every round's drafts land in `log` (on the instance: the class is untouched)."""
    if isinstance(model, zlab.DFlash2DraftModel):
        propose = model.propose

        def recording_propose(*args, **kwargs):
            out = propose(*args, **kwargs)
            log.append(out[0][0].tolist())
            return out

        model.propose = recording_propose
    else:
        compute_logits = model.compute_logits

        def recording_logits(*args, **kwargs):
            logits = compute_logits(*args, **kwargs)
            log.append(logits.argmax(-1)[0].tolist())
            return logits

        model.compute_logits = recording_logits


def counted_as_zlab(accepted: list[int], new_tokens: int) -> list[int]:
    """Our per-round accepted+1, the last round cut to the tokens kept (z-lab's `produced`)."""
    out, total = [], 1  # the first token comes from the prefill, before any round
    for a in accepted:
        out.append(min(a, new_tokens - total))
        total += out[-1]
        if total >= new_tokens:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    args = check_parser(__doc__.splitlines()[0], project="zlab").parse_args(argv)
    zlab = zlab_model_module(args.checkout)
    setup = check_setup(args)
    theirs, info = load_zlab_drafter(zlab, args.drafter)
    block_size = setup.config.block_size
    tally = Tally()
    for i, prompt in enumerate(setup.prompts):
        zlab_log: list = []
        recorded_zlab_drafts(zlab, theirs, zlab_log)
        z = zlab.dflash_generate(
            theirs,
            setup.target,
            torch.tensor([prompt]),
            args.max_new_tokens,
            setup.eos,
            return_stats=True,
        )
        z_tokens = z.output_ids[0, len(prompt) :].tolist()
        spec, ours_log = recorded_decoding(setup, prompt, max_new_tokens=args.max_new_tokens)
        ours_counted = counted_as_zlab(spec.accepted_lengths, len(spec.tokens))
        same = {
            "tokens": spec.tokens == z_tokens,
            "acceptance_lengths": ours_counted == list(z.acceptance_lengths),
            # z-lab shrinks the last blocks to the tokens left, which changes every slot's
            # hidden state (the block attends to itself): drafts compared in full blocks only
            "drafts": len(ours_log) == len(zlab_log)
            and all(o == t for o, t in zip(ours_log, zlab_log, strict=True) if len(t) == len(o)),
        }
        tally.add(
            i,
            same,
            z.acceptance_lengths,
            full_block_rounds=sum(len(t) == block_size - 1 for t in zlab_log),
            shrunk_rounds=sum(len(t) < block_size - 1 for t in zlab_log),
        )
    keys_ok = not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    return reported(args, theirs=theirs, info=info, keys_ok=keys_ok, tally=tally)


if __name__ == "__main__":
    raise SystemExit(main())
