"""Target stage: run the frozen target on a pack and write its features straight into a slot.

Per pack, in the target's DeviceWorker thread, two jobs:
1. `stage_inputs`: the fixed drafter layout is built on the host, put in pinned memory and copied
   onto the target device without blocking (`runner.inputs`). Only then does the stage take a
   free slot, so a slot is never held while the target waits for data or for the loop.
2. `fill_slot`: the target forward chosen at load time (`targets/forward.py`: packed dense, MoE or
   hybrid, else the HF fallback) writes the captured layers into the slot's features (or into a
   staging buffer copied over, when the slot lives on another device), and the layout rows are
   copied into the slot.
Everything runs on the target thread's stream, so one event recorded after the writes tells the
consumer when the slot is ready. On the packed paths no step reads device data on the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_async.data.images import ImageTextSamples
from dflash_async.data.packing import PackedBatch, layout_pack
from dflash_async.data.samples import TokenizedSamples
from dflash_async.log import get_logger
from dflash_async.runtime.channels import ReceiveChannel
from dflash_async.runtime.devices import DeviceWorker
from dflash_async.runtime.meters import BusyMeter, timing_event
from dflash_async.runtime.rings import SlotRing
from dflash_async.stages.read import PlannedPack
from dflash_async.targets.forward import TargetPath, select_target_forward
from dflash_async.targets.loading import fast_kernel_preflight, load_served_target, text_config
from dflash_async.targets.multimodal import load_multimodal_target, multimodal_path
from dflash_async.targets.quantized import WeightFormat
from dflash_async.targets.random_weights import load_random_target


@dataclass(frozen=True)
class TargetSpec:
    """How every target worker loads and runs the target (settings/sections.py: DFLASH_TARGET__*)."""

    cuda_dtype: torch.dtype  # weights and compute on a GPU
    cpu_dtype: torch.dtype  # and on the CPU
    token_budget: int  # T rows of every pack
    max_batch_tokens: int  # most tokens per forward (HF fallback batches)
    packed_hybrid: bool  # Qwen3.5 on CUDA: the packed varlen forward
    stages: int = 1  # stage workers per replica (stages/chain.py), each a range of layers
    quantize: str = "none"  # "fp8": the decoder weights quantized at load (targets/quantized.py)
    weights: str = "checkpoint"  # "random": drawn from the config (targets/random_weights.py)
    seed: int = 0  # DFLASH_TRAIN__SEED: the random target's seed (every rank draws the same)
    decode: bool = True  # the in-run evaluation decodes: a random target is drawn whole
    cuda_graph: bool = False  # replay the packed forward from one CUDA graph (targets/graphed.py)

    def dtype_on(self, device: torch.device) -> torch.dtype:
        return self.cuda_dtype if device.type == "cuda" else self.cpu_dtype

    @property
    def random_seed(self) -> int | None:
        """The seed of a random target (its drafters redraw its embeddings), else None."""
        return self.seed if self.weights == "random" else None


@dataclass
class TargetRunner:
    """A loaded target on one device, its chosen forward and its input staging. Build and use
    in its worker."""

    model: torch.nn.Module
    path: TargetPath
    inputs: PackedBatch  # [T] layout on the target device; features [T, k*d] staging
    meter: BusyMeter = field(default_factory=BusyMeter)  # device time of fill_slot jobs
    random_seed: int | None = None  # a random target's seed (its drafters' embeddings), or None

    @property
    def device(self) -> torch.device:
        return self.inputs.input_ids.device


@dataclass
class StagedPack:
    """A pack whose layout is on its way to the target device (ordered on the target stream)."""

    lengths: np.ndarray  # [n] host: token count of each document
    tokens: int
    documents: int
    # more arguments of the forward: image+text samples' `vision` (one mapping per document)
    inputs: dict = field(default_factory=dict)


def load_runner(
    path: str,
    *,
    spec: TargetSpec,
    device: torch.device,
    layer_ids: tuple[int, ...],
    log=None,
    images: bool = False,
) -> TargetRunner:
    """Load the target on `device` as `spec` says, choose its forward and warm it up (the first
    call compiles). `images`: the data holds image records: the wrapper loads whole and runs
    packed or per document with each one's vision inputs (targets/multimodal.py).

    Call inside that device's worker thread, one worker at a time (torch.compile is not
    thread-safe). Logs the weight format, the fast-kernel preflight and the chosen `target_path`.
    """
    log = log or get_logger(__name__)
    if images and spec.random_seed is None:
        model = load_multimodal_target(path, device=device, dtype=spec.dtype_on(device))
        served = None  # the checkpoint's own dtype format, tower included
        log.info("target_weights_loaded", weight_format="multimodal", device=str(device))
    elif images:  # the wrapper drawn whole, tower included (targets/random_weights.py)
        model, served = load_target_weights(
            path, spec=spec, device=device, last_layer=max(layer_ids), log=log, images=True
        )
    else:
        model, served = load_target_weights(
            path, spec=spec, device=device, last_layer=max(layer_ids), log=log
        )
    for line in fast_kernel_preflight(model):
        log.info("fast_kernel_preflight_checked", line=line, device=str(device))
    if images:
        chosen = multimodal_path(
            model, layer_ids, token_budget=spec.token_budget, packed_hybrid=spec.packed_hybrid
        )
    else:
        chosen = choose_forward(model, spec=spec, layer_ids=layer_ids)
    param = next(model.parameters())
    log_path_chosen(log, chosen, device=device, dtype=param.dtype, served=served)
    width = len(layer_ids) * text_config(model).hidden_size
    inputs = PackedBatch.empty(spec.token_budget, width, device=device, feature_dtype=param.dtype)
    runner = TargetRunner(model, chosen, inputs, random_seed=spec.random_seed)
    started = time.perf_counter()
    _warm_up(runner, spec.token_budget, min(spec.max_batch_tokens, spec.token_budget))
    log.info(
        "target_warmed_up",
        target_path=chosen.name,
        warm_up_s=round(time.perf_counter() - started, 2),
    )
    return runner


def load_target_weights(
    path: str,
    *,
    spec: TargetSpec,
    device: torch.device,
    last_layer: int,
    log,
    runs_on: torch.device | None = None,
    images: bool = False,
    **placement,
) -> tuple[torch.nn.Module, WeightFormat]:
    """The target's weights as `spec` says (checkpoint or random under its seed, its dtype,
    DFLASH_TARGET__QUANTIZE), loaded on `device` and logged (`target_weights_loaded`, with the
    weight format): the one loader of the unsplit and the split target.

    `runs_on`: the device the weights will run on when they load elsewhere (a split target
    loads on the host, then each stage's layers move to its device): its dtype is the one
    loaded. A random target is drawn up to `last_layer` unless spec.decode; `placement`
    (layer_device, tail_device) draws each layer straight onto its stage's device; `images`: a
    random multimodal wrapper is drawn whole, tower included (image data).
    """
    dtype = spec.dtype_on(runs_on or device)
    if spec.random_seed is not None:
        return load_logged_random(
            path,
            device=device,
            dtype=dtype,
            seed=spec.seed,
            last_layer=last_layer,
            decode=spec.decode,
            quantize=spec.quantize,
            log=log,
            images=images,
            **placement,
        )
    model, served = load_served_target(path, device=device, dtype=dtype, quantize=spec.quantize)
    log.info(
        "target_weights_loaded",
        weight_format=served.name,
        quant_method=served.quant_method,
        dequantized=served.dequantized,
        device=str(device),
    )
    return model, served


def choose_forward(
    model: torch.nn.Module,
    *,
    spec: TargetSpec,
    layer_ids: tuple[int, ...],
    layers: range | None = None,
) -> TargetPath:
    """The target's forward as `spec` allows (targets/forward.py), whole or one stage's
    `layers` of a split target."""
    return select_target_forward(
        model,
        layer_ids,
        token_budget=spec.token_budget,
        max_batch_tokens=spec.max_batch_tokens,
        packed_hybrid=spec.packed_hybrid,
        cuda_graph=spec.cuda_graph,
        layers=layers,
    )


def log_path_chosen(
    log,
    chosen: TargetPath,
    *,
    device: torch.device,
    dtype: torch.dtype,
    served: WeightFormat | None,
    **extra,
) -> None:
    """`target_path_chosen`: the forward, why, and the weights' dtype, format and matmul kernel
    (served None: a model built by the caller, its format unknown here)."""
    log.info(
        "target_path_chosen",
        target_path=chosen.name,
        reason=chosen.reason,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        weight_format=served and served.name,
        kernel=served and served.kernel,
        kernel_reason=served and served.kernel_reason,
        **extra,
    )


def load_logged_random(path: str, *, log, **options):
    """`load_random_target` (model, WeightFormat), logged loudly: a warning that its features
    mean nothing to a real drafter, and `target_weights_loaded` with weight_format "random"."""
    started = time.perf_counter()
    model, weights, facts = load_random_target(path, **options)
    device = options.get("device")
    log.warning(
        "target_weights_random",
        path=str(path),
        reason="DFLASH_TARGET__WEIGHTS=random: "
        "weights drawn from the config for throughput runs and benchmarks only; the "
        "features of random weights are meaningless for a real drafter",
    )
    if facts["ignored_weight_files"]:
        log.warning(
            "target_weight_files_ignored",
            files=facts["ignored_weight_files"],
            reason="DFLASH_TARGET__WEIGHTS=random draws the weights, never reads them",
        )
    log.info(
        "target_weights_loaded",
        weight_format=weights.name,
        quant_method=None,
        dequantized=weights.dequantized,
        kernel=weights.kernel,
        device=str(device),
        seed=facts["seed"],
        layers_drawn=facts["layers_drawn"],
        layers_on_meta=facts["layers_on_meta"],
        lm_head_on_meta=facts["lm_head_on_meta"],
        load_s=round(time.perf_counter() - started, 2),
    )
    return model, weights


def _warm_up(runner: TargetRunner, token_budget: int, longest: int) -> None:
    """One forward on a made-up pack of the real shape: compiles and autotunes before training."""
    lengths = [longest // 2, longest - longest // 2]
    docs = [(np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool)) for n in lengths if n]
    layout = layout_pack(docs, token_budget)
    runner.inputs.copy_(layout.to(runner.device), with_features=False)
    ins = runner.inputs
    runner.path.forward(
        ins.input_ids, ins.position_ids, ins.doc_ids, ins.features, np.array(lengths)
    )


def stage_inputs(runner: TargetRunner, samples: TokenizedSamples, pack: PlannedPack) -> StagedPack:
    """Build the pack's layout on the host and copy it onto the target device without blocking."""
    docs = [samples.sample(int(i)) for i in pack.indices]
    layout = layout_pack(docs, runner.inputs.num_tokens)  # host tensors from numpy
    if runner.device.type == "cuda":
        # A fresh pinned block per pack: the caching host allocator reuses it only after the
        # copy's recorded event has completed, so no host wait here (never a reused pinned
        # buffer overwritten under an in-flight copy).
        layout = PackedBatch(*(t.pin_memory() for t in layout.tensors()))
    runner.inputs.copy_(layout, with_features=False)  # non_blocking; ordered before fill_slot
    lengths = np.array([len(d[0]) for d in docs], dtype=np.int64)
    return StagedPack(lengths, int(lengths.sum()), len(docs), pack_inputs(runner, samples, pack))


def pack_inputs(runner: TargetRunner, samples: TokenizedSamples, pack: PlannedPack) -> dict:
    """The forward's arguments beyond the layout: image+text samples' vision inputs, one
    mapping per document on the target device (data/images.py); none for text."""
    if not isinstance(samples, ImageTextSamples):
        return {}
    dtype = next(runner.model.parameters()).dtype
    return {"vision": [samples.model_inputs(int(i), runner.device, dtype) for i in pack.indices]}


@torch.no_grad()
def fill_slot(runner: TargetRunner, staged: StagedPack, slot_batch: PackedBatch):
    """Write the staged pack (layout + target features) into `slot_batch`; returns the written
    event (CUDA) or None (CPU: everything already happened)."""
    ins, device = runner.inputs, runner.device
    started = timing_event(device)
    in_place = slot_batch.features.device == device
    features = slot_batch.features if in_place else ins.features
    runner.path.forward(
        ins.input_ids, ins.position_ids, ins.doc_ids, features, staged.lengths, **staged.inputs
    )
    slot_batch.copy_(ins, with_features=not in_place)  # device copies, on this thread's stream
    written = timing_event(device)  # after every write to the slot
    if written is not None:
        runner.meter.add(started, written)
    return written


async def target_stage(
    worker: DeviceWorker,
    runner: TargetRunner,
    samples: TokenizedSamples,
    packs: ReceiveChannel[PlannedPack],
    ring: SlotRing,
) -> None:
    """Take packs until the channel closes; each takes a free slot once its inputs are staged."""
    try:
        async for pack in packs:
            staged = await worker.run(stage_inputs, runner, samples, pack)
            slot = await ring.acquire_free()  # the backpressure
            event = await worker.run(fill_slot, runner, staged, slot.batch)
            slot.meta.update(cursor=pack.cursor, tokens=staged.tokens, documents=staged.documents)
            ring.publish(slot, event)
    finally:
        packs.close()
