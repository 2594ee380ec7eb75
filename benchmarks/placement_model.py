"""Print the placement model's predictions (BENCHMARKS.md, "Placement model") from one H200's
measured stage rates: tokens/s per GPU of each layout at 1, 2, 4 and 8 GPUs, for today's target
and the compiled packed target, at two anchor densities. CPU only, instant:

    PYTHONPATH=. python benchmarks/placement_model.py
"""

from types import SimpleNamespace

from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.model.flops import drafter_step_flops, target_forward_flops
from dflash_async.pipeline.placement import (
    Links,
    MemoryNeeds,
    StageRates,
    best_split,
    decide,
    predict,
)

T = 16384  # rows per pack of the 1xH200 preset
STEP_S = 0.2882  # measured: compiled drafter step, CUDA graph, 1024 anchors x 16 (BENCHMARKS.md)
TARGETS = {"today (HF, 21.0k)": 21.0e3, "compiled packed (41.1k)": 41.1e3}  # docs/GPU.md
MEAN_DOC = 780  # tokens: 21 documents per 16384-token pack in the measured runs
DRAFTER = DrafterConfig(
    hidden_size=4096, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, intermediate_size=12288, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=151936,
    num_target_layers=36, target_layer_ids=(1, 9, 17, 25, 33), mask_token_id=151669, block_size=16,
)  # fmt: skip
TARGET = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=12288)  # fmt: skip
LINKS = Links(grad_bytes=4 * 1.05e9, feature_bytes_per_token=5 * 4096 * 2)
FITS = MemoryNeeds(20e9, 2e9, 20e9, 16e9, 2e9, 141e9)  # Qwen3-8B: both fit on one H200


def drafter_flops_per_token(anchors: int, mean_context: float) -> float:
    pairs = anchors * 16 * (mean_context + 16)
    return drafter_step_flops(DRAFTER, token_budget=T, num_anchors=anchors, visible_pairs=pairs) / T


def densities() -> dict[str, tuple[float, float]]:
    """name -> (drafter tokens/s alone, drafter FLOPs per token). The sparse recipe is measured;
    the dense one (SpecForge's 512 anchors per 3072-token sequence: 2731 anchors per 16384 rows,
    a mean context of half a sequence) is scaled from it by FLOPs at the same MFU."""
    sparse = drafter_flops_per_token(1024, MEAN_DOC / 2)
    dense = drafter_flops_per_token(round(T * 512 / 3072), 3072 / 2)
    return {
        "1024 per 16384": (T / STEP_S, sparse),
        "512 per 3072": (T / STEP_S * sparse / dense, dense),
    }


def rows():
    target_fpt = target_forward_flops(TARGET, layers_run=34, tokens=1,
                                      attention_pairs=(MEAN_DOC + 1) / 2)  # fmt: skip
    for target_name, target in TARGETS.items():
        for density, (drafter, drafter_fpt) in densities().items():
            rates = StageRates(target, drafter, source="measured",
                               target_flops_per_token=target_fpt,
                               drafter_flops_per_token=drafter_fpt)  # fmt: skip
            for gpus in (1, 2, 4, 8):
                p = predict(rates, gpus=gpus, token_budget=T, links=LINKS)
                split = best_split(rates, gpus=gpus, token_budget=T, links=LINKS)
                chosen = decide("auto", gpus=gpus, rates=rates, memory=FITS, token_budget=T,
                                links=LINKS).layout  # fmt: skip
                yield target_name, density, drafter, gpus, p, split, chosen


def main() -> None:
    print("| target | anchors | drafter tok/s alone | GPUs | colocated tok/s per GPU | "
          "split tok/s per GPU (targets+drafters) | auto |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for target, density, drafter, gpus, p, split, chosen in rows():
        split_text = "—" if split is None else f"{p['split']:,.0f} ({split[0]}+{gpus - split[0]})"
        print(f"| {target} | {density} | {drafter:,.0f} | {gpus} | {p['colocated']:,.0f} | "
              f"{split_text} | {chosen} |")  # fmt: skip


if __name__ == "__main__":
    main()
