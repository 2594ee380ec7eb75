"""Print the placement model's predictions (BENCHMARKS.md, "Placement model") from one H200's
measured stage rates: tokens/s per GPU of each layout at 1, 2, 4 and 8 GPUs, for today's target
and the compiled packed target, at two anchor densities; then the split targets
(DFLASH_TARGET__STAGES): replicas x stages of a 235B-A22B and a ~1T FP8 MoE on 8 and 16 x 141 GB.
CPU only, instant:

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
    hidden_size=4096,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    vocab_size=151936,
    num_target_layers=36,
    target_layer_ids=(1, 9, 17, 25, 33),
    mask_token_id=151669,
    block_size=16,
)
TARGET = SimpleNamespace(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
)
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
    target_fpt = target_forward_flops(
        TARGET, layers_run=34, tokens=1, attention_pairs=(MEAN_DOC + 1) / 2
    )
    for target_name, target in TARGETS.items():
        for density, (drafter, drafter_fpt) in densities().items():
            rates = StageRates(
                target,
                drafter,
                source="measured",
                target_flops_per_token=target_fpt,
                drafter_flops_per_token=drafter_fpt,
            )
            for gpus in (1, 2, 4, 8):
                p = predict(rates, gpus=gpus, token_budget=T, links=LINKS)
                split = best_split(rates, gpus=gpus, token_budget=T, links=LINKS)
                chosen = decide(
                    "auto", gpus=gpus, rates=rates, memory=FITS, token_budget=T, links=LINKS
                ).layout
                yield target_name, density, drafter, gpus, p, split, chosen


# ---- split targets (DFLASH_TARGET__STAGES): replicas x stages --------------------------------
# Weights in FP8 (1 byte per parameter, experts included); per GPU the co-located drafter side
# (the 8B-shaped drafter's state, activations and ring: ~38 GB, FITS above) and the target's
# transient activations (~4 GB at 16k rows) sit beside the stage's weights, within 90% of 141 GB.
# Throughput per replica: an MoE forward costs its ACTIVE parameters (2 FLOPs each per token),
# and with k stages and at least k packs in flight the stages work concurrently, so a replica of
# k stages delivers k times one GPU's rate on its share of the layers: the whole node runs
# gpus * MFU * peak / (2 * active) target tokens/s whatever the split; what the split changes is
# only whether the weights fit. So the choice is: the fewest stages whose per-GPU share fits
# (fewest boundaries: one activation copy each, k-1 bubbles at start), and as many replicas as
# the GPUs allow (more replicas: more packs in flight, less pipeline fill).
MOE_TARGETS = {"235B-A22B FP8": (235e9, 22e9), "~1T-A32B FP8": (1.0e12, 32e9)}
GB = 1e9
BESIDE = 38 * GB + 4 * GB  # drafter side + target activations per GPU (co-located)


def split_choice(total_params: float, gpus: int, *, device_bytes: float = 141 * GB):
    """(replicas, stages, weight bytes per GPU) of the fewest stages that fit; None if none."""
    for stages in (k for k in range(1, gpus + 1) if gpus % k == 0):
        share = total_params / stages  # balanced by bytes (targets/split.py)
        if share + BESIDE <= 0.9 * device_bytes:
            return gpus // stages, stages, share
    return None


def split_rows():
    for name, (total, active) in MOE_TARGETS.items():
        for gpus in (8, 16):
            chosen = split_choice(total, gpus)
            rate = gpus * 0.5 * 780e12 / (2 * active)  # target tokens/s of the node at MFU 0.5
            yield name, gpus, chosen, rate


def main() -> None:
    print(
        "| target | anchors | drafter tok/s alone | GPUs | colocated tok/s per GPU | "
        "split tok/s per GPU (targets+drafters) | auto |"
    )
    print("|---|---|---|---|---|---|---|")
    for target, density, drafter, gpus, p, split, chosen in rows():
        split_text = "—" if split is None else f"{p['split']:,.0f} ({split[0]}+{gpus - split[0]})"
        print(
            f"| {target} | {density} | {drafter:,.0f} | {gpus} | {p['colocated']:,.0f} | "
            f"{split_text} | {chosen} |"
        )
    print()
    print(
        "| target (FP8) | GPUs (141 GB) | replicas x stages | weights per GPU | "
        "target tok/s (node, MFU 0.5) | why |"
    )
    print("|---|---|---|---|---|---|")
    for name, gpus, chosen, rate in split_rows():
        if chosen is None:
            share = MOE_TARGETS[name][0] / gpus
            print(
                f"| {name} | {gpus} | — | {share / GB:.0f} GB at {gpus} stages | — | exit 2: "
                f"no room beside it for the co-located drafter ({BESIDE / GB:.0f} GB); only "
                "drafter-free target GPUs (the split layout, not yet with STAGES) could hold it "
                "|"
            )
            continue
        replicas, stages, share = chosen
        why = (
            f"{stages} is the fewest stages whose share ({share / GB:.0f} GB) fits beside the "
            f"drafter ({BESIDE / GB:.0f} GB) in 90% of 141 GB; {replicas} replica(s) fill "
            "the node"
        )
        print(
            f"| {name} | {gpus} | {replicas} x {stages} | {share / GB:.0f} GB | {rate:,.0f} | "
            f"{why} |"
        )


if __name__ == "__main__":
    main()
