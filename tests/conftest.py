"""Shared builders: tiny random drafter configs, drafters, frozen target weights and packed batches.

Everything is seeded, so each test sees the same numbers on every run. Weights are drawn at scale
1/sqrt(fan_in) and norm weights near 1 (not HF's 0.02 init): logits then move by O(1) when an input
that should matter changes, so "changed" and "unchanged" are far apart even in float32.
"""

from __future__ import annotations

import functools
import gc
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dflash_async.data.packing import PackedBatch
from dflash_async.model.drafter_config import DrafterConfig, default_target_layer_ids


def pytest_configure(config: pytest.Config) -> None:
    """flash-linear-attention's kernels take the fixed configs in benchmarks/fla_configs (as
    benchmarks/gpu.sh sets them) unless the environment names others: left to autotune, each new
    shape tries 75 configs per kernel, and the hybrid tests' dozen shapes in fp32 and bf16 ran
    past a 300 s test limit on an H100. Set before any test module imports fla."""
    configs = Path(__file__).resolve().parent.parent / "benchmarks" / "fla_configs"
    if configs.is_dir():
        os.environ.setdefault("FLA_CACHE_MODE", "default")
        os.environ.setdefault("FLA_CONFIG_DIR", str(configs))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu`-marked tests on machines without CUDA (the CPU CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def gpu_memory_returned(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each `gpu` test: its garbage collected and the caching allocator's free blocks given
    back to the driver, so that pytest workers sharing one card do not keep each other's peaks
    (a worker was seen holding 18 GiB of cache while others ran out of memory). With
    DFLASH_TEST_GPU_MEMORY=FILE, one JSON line per test: the most memory it reserved in this
    process, what a card must hold for it (module fixtures' tensors included; a run it starts
    as a subprocess not counted)."""
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    torch.cuda.reset_peak_memory_stats()
    yield
    peak = torch.cuda.max_memory_reserved()
    gc.collect()
    torch.cuda.empty_cache()
    if path := os.environ.get("DFLASH_TEST_GPU_MEMORY"):
        line = {"test": request.node.nodeid, "peak_reserved_gib": round(peak / 2**30, 2)}
        with open(path, "a") as f:  # one short line per append: workers' lines do not mix
            f.write(json.dumps(line) + "\n")


@functools.cache
def compiled_sdpa_float64_problem() -> str | None:
    """Why CPU inductor cannot differentiate a boolean-masked SDPA in float64 on this torch, or
    None. torch 2.11 cannot (the backward raises "expected scalar type Double but found Float");
    2.13 can. Probed once per process (one small compile)."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    sdpa = torch.compile(torch.nn.functional.scaled_dot_product_attention, dynamic=False)
    try:
        sdpa(q, q, q, attn_mask=mask).sum().backward()
    except RuntimeError as error:
        return f"torch {torch.__version__}: compiled float64 SDPA backward fails ({error})"[:200]
    return None


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One intra-op thread for tiny tensors: on a busy 2-core machine OpenMP workers spin-wait and
    made these tests ~5x slower (measured: 4.8 s vs 25-45 s for the objective tests)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """`single_thread` for a whole module, so that module-scoped fixtures (a tiny target, its
    greedy continuations) are built on one thread too: tiny matmuls decode several times (up to
    20x, measured) faster on one thread when the two cores are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    """The in-memory tokenizer with Qwen3's special tokens and chat template (fixtures/), built
    once per module (imported here lazily: tests without it do not load transformers for it)."""
    from fixtures.chat_tokenizer import qwen3_like_tokenizer

    return qwen3_like_tokenizer()


@dataclass(frozen=True)
class TinySpec:
    """One tiny drafter + pack. head_dim is set apart from hidden/heads on purpose."""

    hidden_size: int = 32
    head_dim: int = 16
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 64
    vocab_size: int = 97
    num_hidden_layers: int = 2
    num_features: int = 2
    block_size: int = 4
    rope_theta: float = 1000.0
    doc_lengths: tuple[int, ...] = (20, 25, 11)
    num_pad: int = 8
    seed: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.doc_lengths) + self.num_pad


def tiny_config(spec: TinySpec) -> DrafterConfig:
    num_target_layers = 8
    return DrafterConfig(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        rms_norm_eps=1e-6,
        rope_theta=spec.rope_theta,
        vocab_size=spec.vocab_size,
        num_target_layers=num_target_layers,
        target_layer_ids=default_target_layer_ids(num_target_layers, spec.num_features),
        mask_token_id=spec.vocab_size - 1,  # never drawn as a data token below
        block_size=spec.block_size,
    )


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Matrices ~ N(0, 1/fan_in), vectors (norm weights) ~ 1 + 0.2 N(0, 1); in place, seeded."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(module.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            value = noise / param.shape[-1] ** 0.5 if param.ndim > 1 else 1 + 0.2 * noise
            param.copy_(value)


def tiny_drafter(
    config: DrafterConfig, seed: int, dtype: torch.dtype = torch.float64, device: str = "cpu"
) -> torch.nn.Module:
    from dflash_async.model.drafter import DFlashDrafter  # lazy: anchor tests run without it

    drafter = DFlashDrafter(config).to(device=device, dtype=dtype)
    randomize_(drafter, seed)
    return drafter


def tiny_target_weights(
    config: DrafterConfig, seed: int, dtype: torch.dtype = torch.float64, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target's embed_tokens [V, d] and lm_head [V, d] (plain tensors, no grad)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    v, d = config.vocab_size, config.hidden_size
    embed = torch.randn(v, d, generator=gen, dtype=torch.float64)
    lm_head = torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5
    return embed.to(device, dtype), lm_head.to(device, dtype)


def doc_loss_mask(length: int) -> list[bool]:
    """A prompt (first quarter, unsupervised), then the response with a 2-token hole in its middle."""
    prompt = max(1, length // 4)
    mask = [i >= prompt for i in range(length)]
    if length >= 12:
        mid = (prompt + length) // 2
        mask[mid] = mask[mid + 1] = False
    return mask


def tiny_batch(
    spec: TinySpec, config: DrafterConfig, dtype: torch.dtype = torch.float64, device: str = "cpu"
) -> PackedBatch:
    """Documents end to end, then padding (doc -1, loss_mask False, position 0), per PackedBatch.

    Every third document (index 2, 5, ...) is supervised from its first token, so blocks at the end
    of the document before it run into supervised rows: the same-document checks then matter.
    """
    gen = torch.Generator().manual_seed(spec.seed + 2000)
    ids, mask, docs, pos = [], [], [], []
    for doc, length in enumerate(spec.doc_lengths):
        ids += torch.randint(0, config.vocab_size - 1, (length,), generator=gen).tolist()
        mask += [True] * length if doc % 3 == 2 else doc_loss_mask(length)
        docs += [doc] * length
        pos += list(range(length))
    ids += [0] * spec.num_pad
    mask += [False] * spec.num_pad
    docs += [-1] * spec.num_pad
    pos += [0] * spec.num_pad
    width = config.feature_width  # the drafter's k layers (and a captured last layer)
    features = torch.randn(len(ids), width, generator=gen, dtype=torch.float64)
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        doc_ids=torch.tensor(docs, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        features=features.to(dtype),
    ).to(device)


def make_anchors(positions: Sequence[int], num_anchors: int, device: str = "cpu"):
    """Anchors with the valid positions sorted first, then invalid slots at position 0."""
    from dflash_async.model.objective import Anchors  # lazy: reference-only tests run without it

    valid = sorted(set(positions))
    if len(valid) > num_anchors:
        raise ValueError(f"{len(valid)} anchors do not fit in num_anchors={num_anchors}")
    pad = num_anchors - len(valid)
    return Anchors(
        positions=torch.tensor(valid + [0] * pad, dtype=torch.long, device=device),
        valid=torch.tensor([True] * len(valid) + [False] * pad, device=device),
    )


def make_objective(
    config: DrafterConfig,
    drafter: torch.nn.Module,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    *,
    num_anchors: int,
    gamma: float = 4.0,
    ce_chunk_size: int = 2048,
    attention: str = "sdpa",
):
    from dflash_async.model.objective import DFlashObjective, ObjectiveConfig

    objective_config = ObjectiveConfig(
        block_size=config.block_size,
        num_anchors=num_anchors,
        mask_token_id=config.mask_token_id,
        gamma=gamma,
        ce_chunk_size=ce_chunk_size,
        attention=attention,
    )
    return DFlashObjective(objective_config, drafter, embed, lm_head)


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    """Every async test runs on plain asyncio and on uvloop (the loop `run` uses)."""
    return request.param
