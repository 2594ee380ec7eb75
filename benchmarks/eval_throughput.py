"""Batched greedy and speculative decoding throughput on a Qwen3-8B-shaped random target (GPU).

    python benchmarks/eval_throughput.py [--prompts 64] [--max-new-tokens 256] [--batch-size 64]

Builds the target directly on the GPU (random bf16 weights, no disk), an untrained 5-layer B=16
drafter, and `--prompts` random prompts of 64..512 tokens. Decodes them as `eval` does
(dflash_async.eval.evaluation): the plain-greedy baseline once, then speculatively with the
untrained drafter (tau ~1: the worst case) and with an oracle that drafts the baseline's own
continuation (tau up to B: the ceiling of the verify path). Every speculative sample is checked
against the baseline (numerical ties of bf16 counted). Prints one JSON line per decoder.
"""

import argparse
import json

import torch
from make_random_target import qwen3_8b_config
from transformers import AutoModelForCausalLM

from dflash_async.eval.batched_decoding import BatchedDecode
from dflash_async.eval.evaluation import (
    DecodeSetup,
    greedy_decoders,
    report,
    run_decoders,
    speculative_decoders,
)
from dflash_async.eval.lossless import LosslessError
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.model.drafter_config import drafter_config_from_target


class BaselineOracle:
    """Drafts the greedy baseline's continuation (row b = prompt b), on the device, no sync."""

    def __init__(self, sequences: list[list[int]], block_size: int, device: torch.device) -> None:
        width = max(map(len, sequences)) + 2 * block_size
        self.truth = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
        for i, seq in enumerate(sequences):
            self.truth[i, : len(seq)] = torch.tensor(seq, device=device)
        self.config = type("Config", (), {"block_size": block_size})()

    def extend_context(self, features, positions, rows=slice(None)) -> None:
        pass

    def draft(self, anchors: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        slots = positions[:, None] + torch.arange(1, self.config.block_size, device=anchors.device)
        return self.truth.gather(1, slots.clamp(max=self.truth.shape[1] - 1))  # [b, B-1]


def oracle_run(setup: DecodeSetup, plain, block_size: int, layer_ids):
    """Speculative decoding with BaselineOracle, batch by batch; (results, seconds)."""
    device, size = setup.device, setup.batch_size
    sequences = [p + g.tokens for p, g in zip(setup.prompts, plain, strict=True)]
    factories = [
        lambda i=i: BatchedDecode(
            setup.target,
            setup.prompts[i : i + size],
            draft=BaselineOracle(sequences[i : i + size], block_size, device),
            layer_ids=layer_ids,
            max_new_tokens=setup.max_new_tokens,
            eos=setup.eos,
            suppress=setup.suppress,
        )
        for i in range(0, len(setup.prompts), size)
    ]
    return run_decoders(factories, device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="a tiny fp32 target on the CPU")
    args = parser.parse_args()
    target_config, dtype, device = qwen3_8b_config(), torch.bfloat16, torch.device("cuda", 0)
    if args.smoke:  # checks this script on a machine without a GPU
        target_config.update(
            dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=6,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                vocab_size=1000,
            )
        )
        dtype, device = torch.float32, torch.device("cpu")
    else:
        torch.cuda.set_device(device)
    vocab = target_config.vocab_size
    with device:
        torch.manual_seed(0)
        target = AutoModelForCausalLM.from_config(target_config, dtype=dtype)
        target = target.eval().requires_grad_(False)
        features = 2 if args.smoke else 5  # 5 of 36 layers for Qwen3-8B (DFLASH.md s.1)
        config = drafter_config_from_target(
            target.config, mask_token_id=vocab - 1, num_features=features
        )
        drafter = DFlashDrafter(config).to(dtype).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 513, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in lengths]
    setup = DecodeSetup(target, prompts, args.max_new_tokens, frozenset(), (), args.batch_size)
    warm = DecodeSetup(target, prompts[: args.batch_size], 32, frozenset(), (), args.batch_size)
    run_decoders(greedy_decoders(warm), device)  # untimed: cuBLAS handles, allocator, kernels
    run_decoders(speculative_decoders(warm, drafter, config), device)
    plain, plain_s = run_decoders(greedy_decoders(setup), device)
    runs = {
        "untrained_drafter": run_decoders(speculative_decoders(setup, drafter, config), device),
        "oracle_drafter": oracle_run(setup, plain, config.block_size, config.target_layer_ids),
    }
    for name, (spec, spec_s) in runs.items():
        try:
            summary = report(
                setup,
                plain,
                spec,
                block_size=config.block_size,
                plain_s=plain_s,
                speculative_s=spec_s,
                tie_tolerance=0.5,
            )
        except LosslessError as e:
            print(json.dumps({"event": "bench_eval_failed", "drafter": name, "error": str(e)}))
            continue
        summary.pop("samples")
        summary.pop("accepted_length_histogram")
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        print(
            json.dumps(
                {"event": "bench_eval", "drafter": name, "peak_gib": round(mem, 1)} | summary
            )
        )


if __name__ == "__main__":
    main()
