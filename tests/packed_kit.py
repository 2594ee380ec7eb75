"""What the packed target forwards' parity tests (tests/targets/test_target_packed*.py) share:
random documents and the slot's poisoned feature buffer, a forward or a selected path run on a
packed layout, and the comparison of every packed row with its document run alone through HF
(the padding rows asserted zero), exact to a tolerance or as a distance. Also the bodies every
family repeats: the selected CPU path packed and exact, two chained stages writing the whole
forward's features, flex on the CPU writing SDPA's, the GPU rows within HF's own fp32 error of
fp64; and a forward's module rebuilt from its source with edits (the mutants the comparison must
catch). What differs per family (its configs, forwards, mutant edits, tolerances and their
derivations) stays in its test file.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

import numpy as np
import torch
from target_kit import capture_features

from dflash_async.data.packing import layout_pack, pack_row_offsets
from dflash_async.targets.forward import select_target_forward

Documents = list[tuple[np.ndarray, np.ndarray]]


def documents(*, vocab: int, lengths: Sequence[int], seed: int = 0) -> Documents:
    """Documents of `lengths` random token ids below `vocab` (every token a loss token)."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, n), np.ones(n, dtype=bool)) for n in lengths]


def nan_features(*, rows: int, width: int, device: str = "cpu") -> torch.Tensor:
    """The slot's buffer [rows, width], poisoned: every row must be written."""
    return torch.full((rows, width), float("nan"), device=device)


def run_packed(
    forward, docs: Documents, *, budget: int, width: int, device: str = "cpu"
) -> torch.Tensor:
    """What a packed forward (ids, positions, doc ids, out) writes for the pack of `docs`."""
    layout = layout_pack(docs, budget).to(device)
    out = nan_features(rows=budget, width=width, device=device)
    return forward(layout.input_ids, layout.position_ids, layout.doc_ids, out)


def run_path(
    forward, docs: Documents, *, budget: int, width: int, device: str = "cpu"
) -> torch.Tensor:
    """What a path's forward (ids, positions, doc ids, out and the host lengths: a selected
    path's `forward`) writes for the pack of `docs`."""
    layout = layout_pack(docs, budget).to(device)
    out = nan_features(rows=budget, width=width, device=device)
    lengths = np.array([len(ids) for ids, _ in docs])
    forward(layout.input_ids, layout.position_ids, layout.doc_ids, out, lengths)
    return out


def selected_path_features(
    model,
    docs: Documents,
    *,
    name: str,
    layer_ids: Sequence[int],
    budget: int,
    width: int,
    max_batch_tokens: int = 64,
) -> torch.Tensor:
    """select_target_forward's CPU path for `model`, asserted to be `name`, run on `docs`."""
    path = select_target_forward(
        model, layer_ids, token_budget=budget, max_batch_tokens=max_batch_tokens
    )
    assert path.name == name, path.reason
    return run_path(path.forward, docs, budget=budget, width=width)


def staged_features(
    model,
    docs: Documents,
    *,
    splits: Sequence[range],
    layer_ids: Sequence[int],
    budget: int,
    width: int,
    max_batch_tokens: int = 64,
) -> torch.Tensor:
    """The features a split target (targets/split.py) writes: one selected stage per layer range
    of `splits`, in order, each handed the hidden state the one before returned."""
    layout = layout_pack(docs, budget)
    args = (layout.input_ids, layout.position_ids, layout.doc_ids)
    out = nan_features(rows=budget, width=width)
    lengths = np.array([len(ids) for ids, _ in docs])
    hidden = None
    for layers in splits:
        stage = select_target_forward(
            model, layer_ids, token_budget=budget, max_batch_tokens=max_batch_tokens, layers=layers
        )
        hidden = stage.stage(hidden, *args, out, lengths)
    return out


def assert_flex_writes_the_sdpa_features(
    forward_of: Callable[[str], object],
    docs: Documents,
    *,
    width: int,
    atol: float,
    budget: int = 256,
) -> None:
    """The forward `forward_of(attention)` writes the same pack with flex as with SDPA, to
    `atol` (rtol 0)."""
    sdpa, flex = (
        run_packed(forward_of(a), docs, budget=budget, width=width) for a in ("sdpa", "flex")
    )
    torch.testing.assert_close(flex, sdpa, atol=atol, rtol=0)


def assert_padding_rows_zero(packed: torch.Tensor, lengths: Sequence[int]) -> np.ndarray:
    """Asserts the rows past the documents' are exactly zero; returns the documents' offsets."""
    offsets = pack_row_offsets(np.array(lengths))
    assert torch.equal(packed[offsets[-1] :], torch.zeros_like(packed[offsets[-1] :]))
    return offsets


def assert_rows_equal_each_document_alone(
    model,
    docs: Documents,
    packed: torch.Tensor,
    *,
    layer_ids: Sequence[int],
    atol: float,
    rtol: float = 0.0,
    features: Callable | None = None,
) -> None:
    """Every packed row equals its document run alone through HF (`features(model, ids)` [n,
    k*d] for ids [1, n], by default its captured layers), to atol + rtol, the failure naming
    the document; the padding rows exactly zero."""
    offsets = pack_row_offsets(np.array([len(d[0]) for d in docs]))
    for j, (ids, _) in enumerate(docs):
        ids = torch.as_tensor(ids, device=packed.device)[None]
        if features is None:
            alone = capture_features(model, ids, torch.ones_like(ids), layer_ids)[0]
        else:
            alone = features(model, ids)
        rows = packed[offsets[j] : offsets[j + 1]]
        torch.testing.assert_close(rows, alone, atol=atol, rtol=rtol, msg=f"document {j}")
    assert_padding_rows_zero(packed, [len(d[0]) for d in docs])


def alone_features(model, docs: Documents, *, layer_ids: Sequence[int]) -> list[torch.Tensor]:
    """Each document run alone through HF on the model's device: its captured layers [n, k*d]."""
    device = next(model.parameters()).device
    rows = []
    for ids, _ in docs:
        ids = torch.as_tensor(ids, device=device)[None]
        rows.append(capture_features(model, ids, torch.ones_like(ids), layer_ids)[0])
    return rows


def max_deviation(packed: torch.Tensor, alone: Sequence[torch.Tensor]) -> float:
    """Largest |packed row - document-alone row| (compared on the CPU); asserts the padding
    rows are exactly zero."""
    packed = packed.cpu()
    offsets = assert_padding_rows_zero(packed, [len(a) for a in alone])
    return max(
        float((packed[offsets[j] : offsets[j + 1]] - a.cpu()).abs().max())
        for j, a in enumerate(alone)
    )


def distance_to_hf(model, docs: Documents, packed: torch.Tensor, *, layer_ids) -> float:
    """Largest |packed - HF| over the real rows, each document alone through `model`; asserts
    the padding rows are zero."""
    return max_deviation(packed, alone_features(model, docs, layer_ids=layer_ids))


def assert_gpu_rows_as_close_to_fp64_as_hf(
    model, build: Callable, docs: Documents, *, layer_ids: Sequence[int], budget: int
) -> None:
    """The GPU parity check of a family whose fp32 rounding is too large for a fixed tolerance
    (a sharp softmax, sublayer outputs normed again): `build(inner)` on a CUDA copy of `model`
    (its decoder stack) gives the packed forward, run in fp32 on the pack of `docs`.

    The reference is HF in fp64 on the CPU, each document alone (experts as the eager loop:
    torch's grouped matmul has no fp64); HF fp32 on the GPU, each document alone, sets the noise.
    Both fp32 paths compute the same sums in different orders, so their errors are of one size,
    but one document's error is one draw of the rounding (packed / HF ranged 0.79-2.5 per document
    over the families measured). So the noise is the largest HF error over the documents, and the
    bound 3x that, with a floor of 4 fp32 ulps of the largest feature for a case where HF is
    nearly exact. The padding rows must be exactly zero."""
    from dflash_async.targets.loading import text_model

    exact = copy.deepcopy(model).double()
    exact.set_experts_implementation("eager")
    ref = alone_features(exact, docs, layer_ids=layer_ids)
    gpu = copy.deepcopy(model).float().cuda()
    width = ref[0].shape[-1]
    out = run_packed(build(text_model(gpu)), docs, budget=budget, width=width, device="cuda")
    packed_err = max_deviation(out.cpu().double(), ref)  # asserts the padding rows zero
    hf = alone_features(gpu, docs, layer_ids=layer_ids)
    hf_err = max(float((h.cpu().double() - r).abs().max()) for h, r in zip(hf, ref, strict=True))
    floor = 4 * torch.finfo(torch.float32).eps * max(float(r.abs().max()) for r in ref)
    assert packed_err <= 3 * max(hf_err, floor), (packed_err, hf_err)


def mutant_module(module: ModuleType, *edits: tuple[str, str], every: bool = False) -> ModuleType:
    """`module` built again from its source with each (old, new) of `edits` applied, as the
    module `<its name>_mutant`. `old` must occur exactly once, or (`every`) at least once, every
    occurrence replaced."""
    source = inspect.getsource(module)
    for old, new in edits:
        assert (old in source) if every else (source.count(old) == 1), old
        source = source.replace(old, new)
    name = f"{module.__name__.rsplit('.', 1)[-1]}_mutant"
    mutant = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    sys.modules[name] = mutant  # its dataclasses look their module up while it is executed
    try:
        exec(compile(source, name, "exec"), mutant.__dict__)
    finally:
        del sys.modules[name]
    return mutant
