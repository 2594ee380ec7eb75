"""checkpoint/export.py and checkpoint/state.py: the export is exactly the servable format (docs/DFLASH.md s.7,
s.6 bug 5), loads back identically and tolerates other tools' exports; the training state that
`run` saves restores a step exactly and in place; every write is atomic and respects the umask."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from conftest import (
    TinySpec,
    make_objective,
    tiny_batch,
    tiny_config,
    tiny_drafter,
    tiny_target_weights,
)
from safetensors import safe_open
from safetensors.torch import save_file
from structlog.testing import capture_logs
from torch import nn
from transformers import Qwen3Config

from dflash_async.checkpoint import export as checkpoint
from dflash_async.checkpoint.export import (
    expected_weight_shapes,
    export_bytes,
    export_drafter,
    load_drafter_export,
)
from dflash_async.checkpoint.space import check_output_space, free_bytes
from dflash_async.checkpoint.state import (
    HostStaging,
    checkpoint_bytes,
    list_checkpoints,
    load_checkpoint,
    restore,
    snapshot,
    write_checkpoint,
)
from dflash_async.data.packing import PackCursor
from dflash_async.errors import SettingsError
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.model.step import DrafterStep

CONFIG = DrafterConfig(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=48,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    vocab_size=151936,
    num_target_layers=36,
    target_layer_ids=(1, 9, 17, 25, 33),
    mask_token_id=151669,
    block_size=16,
)


def _fake_drafter(config: DrafterConfig, seed: int = 0) -> nn.Module:
    """A module whose parameters have exactly the drafter's names and shapes (fp32 masters)."""
    torch.manual_seed(seed)
    root = nn.Module()
    for name, shape in expected_weight_shapes(config).items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.randn(shape)))
    root.register_buffer("inv_freq", torch.ones(4), persistent=False)
    return root


def _siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p != folder)


def test_exported_config_has_every_servable_key_with_the_right_value(tmp_path: Path) -> None:
    out = export_drafter(_fake_drafter(CONFIG), CONFIG, tmp_path / "drafter")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    assert cfg["architectures"] == ["DFlashDraftModel"]
    expected = {
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 48,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "vocab_size": 151936,
        "num_hidden_layers": 2,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention", "full_attention"],
        "block_size": 16,
        "num_target_layers": 36,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["dflash_config"]["mask_token_id"] == 151669
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert cfg["rope_parameters"]["rope_theta"] == 1_000_000.0
    assert isinstance(cfg["max_position_embeddings"], int)


def test_exported_weights_are_exactly_the_flat_names_in_bf16(tmp_path: Path) -> None:
    out = export_drafter(_fake_drafter(CONFIG), CONFIG, tmp_path / "drafter")
    expected = expected_weight_shapes(CONFIG)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(expected)  # no model. prefix, no embed_tokens, no lm_head, no buffers
        for name in names:
            t = f.get_tensor(name)
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == expected[name]
    assert "layers.1.self_attn.k_norm.weight" in names and "fc.weight" in names
    assert expected["fc.weight"] == (32, 5 * 32)


def test_export_then_load_gives_identical_config_and_tensors(tmp_path: Path) -> None:
    drafter = _fake_drafter(CONFIG)
    config, tensors = load_drafter_export(export_drafter(drafter, CONFIG, tmp_path / "d"))
    assert config == CONFIG
    for name, p in drafter.named_parameters():
        assert torch.equal(tensors[name], p.detach().to(torch.bfloat16))


def test_qwen3_config_accepts_the_exported_config_json(tmp_path: Path) -> None:
    out = export_drafter(_fake_drafter(CONFIG), CONFIG, tmp_path / "d")
    hf = Qwen3Config(**json.loads((out / "config.json").read_text()))
    assert (hf.hidden_size, hf.num_hidden_layers, hf.head_dim) == (32, 2, 16)
    assert hf.layer_types == ["full_attention", "full_attention"]
    assert hf.rope_parameters["rope_theta"] == 1_000_000.0
    assert hf.dflash_config["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert (hf.block_size, hf.num_target_layers, hf.tie_word_embeddings) == (16, 36, False)


def test_export_of_a_state_dict_equals_export_of_the_module(tmp_path: Path) -> None:
    drafter = _fake_drafter(CONFIG)
    state = {f"_orig_mod.{k}": v for k, v in drafter.state_dict().items()}  # a compiled module
    _, from_state = load_drafter_export(export_drafter(state, CONFIG, tmp_path / "a"))
    _, from_module = load_drafter_export(export_drafter(drafter, CONFIG, tmp_path / "b"))
    assert all(torch.equal(from_state[k], from_module[k]) for k in from_module)


def test_export_names_extra_and_missing_parameters(tmp_path: Path) -> None:
    state = dict(_fake_drafter(CONFIG).state_dict())
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        export_drafter({**state, "lm_head.weight": torch.zeros(1)}, CONFIG, tmp_path / "d")
    del state["norm.weight"]
    with pytest.raises(ValueError, match=r"missing drafter tensors \['norm\.weight'\]"):
        export_drafter(state, CONFIG, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def _write_foreign_export(folder: Path, tensors: dict[str, torch.Tensor], cfg: dict) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "model.safetensors"))


def test_load_drops_model_prefix_and_embed_and_lm_head_with_a_log_line(tmp_path: Path) -> None:
    ours = export_drafter(_fake_drafter(CONFIG), CONFIG, tmp_path / "ours")
    _, expected = load_drafter_export(ours)
    foreign = {f"model.{k}": v for k, v in expected.items()}
    foreign["model.embed_tokens.weight"] = torch.zeros(8, 32, dtype=torch.bfloat16)
    foreign["lm_head.weight"] = torch.zeros(8, 32, dtype=torch.bfloat16)
    cfg = json.loads((ours / "config.json").read_text())
    del cfg["block_size"], cfg["rope_theta"]  # z-lab style: block_size in dflash_config only
    _write_foreign_export(tmp_path / "foreign", foreign, cfg)
    with capture_logs() as logs:
        config, tensors = load_drafter_export(tmp_path / "foreign")
    assert config == CONFIG
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    dropped = [e for e in logs if e["event"] == "drafter_export_keys_dropped"]
    assert dropped[0]["dropped"] == ["embed_tokens.weight", "lm_head.weight"]


def test_load_names_missing_tensors_and_config_fields(tmp_path: Path) -> None:
    ours = export_drafter(_fake_drafter(CONFIG), CONFIG, tmp_path / "ours")
    _, tensors = load_drafter_export(ours)
    cfg = json.loads((ours / "config.json").read_text())
    del tensors["layers.0.mlp.up_proj.weight"]
    _write_foreign_export(tmp_path / "a", tensors, cfg)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.weight"):
        load_drafter_export(tmp_path / "a")
    del cfg["dflash_config"]["target_layer_ids"], cfg["num_target_layers"]
    _write_foreign_export(tmp_path / "b", tensors, cfg)
    with pytest.raises(ValueError, match=r"num_target_layers.*dflash_config\.target_layer_ids"):
        load_drafter_export(tmp_path / "b")


def test_load_rejects_a_wrongly_shaped_tensor(tmp_path: Path) -> None:
    ours = export_drafter(_fake_drafter(CONFIG), CONFIG, tmp_path / "ours")
    _, tensors = load_drafter_export(ours)
    tensors["fc.weight"] = tensors["fc.weight"][:, :64].contiguous()  # 2 target layers, not 5
    _write_foreign_export(tmp_path / "bad", tensors, json.loads((ours / "config.json").read_text()))
    with pytest.raises(ValueError, match=r"fc\.weight.*\(32, 64\), \(32, 160\)"):
        load_drafter_export(tmp_path / "bad")


def test_export_replaces_an_earlier_export_and_leaves_no_temporaries(tmp_path: Path) -> None:
    out = tmp_path / "drafter"
    export_drafter(_fake_drafter(CONFIG, seed=0), CONFIG, out)
    newer = _fake_drafter(CONFIG, seed=1)
    export_drafter(newer, CONFIG, out)
    _, tensors = load_drafter_export(out)
    assert torch.equal(tensors["norm.weight"], newer.norm.weight.detach().to(torch.bfloat16))
    assert _siblings(out) == []


def test_failed_export_leaves_the_previous_export_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = export_drafter(_fake_drafter(CONFIG, seed=0), CONFIG, tmp_path / "drafter")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        export_drafter(_fake_drafter(CONFIG, seed=1), CONFIG, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _siblings(out) == []


def test_export_refuses_to_replace_a_folder_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not an earlier copy of this output"):
        export_drafter(_fake_drafter(CONFIG), CONFIG, tmp_path / "home")
    assert (tmp_path / "home" / "notes.txt").read_text() == "keep me"


def _step(seed: int, *, working_weights: bool = False) -> DrafterStep:
    """A float32 CPU drafter step of the tiny drafter, its own anchor generator seeded
    (working_weights: the matmul weights' working copies, fp32 on the CPU, and the folded
    update they need)."""
    spec = TinySpec()
    config = tiny_config(spec)
    drafter = tiny_drafter(config, seed=seed, dtype=torch.float32)
    embed, lm_head = tiny_target_weights(config, seed=0, dtype=torch.float32)
    objective = make_objective(config, drafter, embed, lm_head, num_anchors=8, ce_chunk_size=16)
    step = DrafterStep.build(
        objective,
        token_budget=spec.num_tokens,
        peak_lr=1e-2,
        warmup_steps=2,
        total_steps=10,
        generator=torch.Generator().manual_seed(seed),
        working_weights=working_weights,
    )
    step.batch.copy_(tiny_batch(spec, config, dtype=torch.float32))
    return step


def _train(step: DrafterStep, n: int) -> list[float]:
    ce = []
    for _ in range(n):
        step.phase_a()
        ce.append(step.stats[0].item())
        step.phase_b()
    return ce


def _state(step: DrafterStep, n: int) -> dict:
    run = {"DFLASH_TRAIN__SEED": 0}
    return snapshot([step], step=n, cursor=PackCursor(0, n), seed=0, run=run)


@pytest.mark.parametrize("working_weights", [False, True], ids=["masters", "working_copies"])
def test_restored_step_continues_exactly_and_in_place(
    tmp_path: Path, single_thread, working_weights: bool
) -> None:
    """With working copies, restore must set them from the restored masters too: copies left
    at the fresh step's weights would make the next forward use them."""
    original = _step(seed=0, working_weights=working_weights)
    _train(original, 2)
    folder, size = write_checkpoint(tmp_path, _state(original, 2), keep=2)
    assert size == sum(f.stat().st_size for f in folder.iterdir())
    # other weights and generator: everything must come from the file
    resumed = _step(seed=1, working_weights=working_weights)
    pointers = [p.data_ptr() for p in resumed.params] + [resumed.schedule.lr.data_ptr()]
    restore(resumed, load_checkpoint(folder), rank=0)
    # in place: a captured graph keeps reading the same tensors
    assert [p.data_ptr() for p in resumed.params] + [resumed.schedule.lr.data_ptr()] == pointers
    assert resumed.optimizer.param_groups[0]["lr"] is resumed.schedule.lr
    assert _train(resumed, 3) == _train(original, 3)
    for p, q in zip(original.params, resumed.params, strict=True):
        assert torch.equal(p, q)
    # a second restore, now into existing AdamW state, is in place too
    state_pointers = [v.data_ptr() for s in resumed.optimizer.state.values() for v in s.values()]
    restore(resumed, load_checkpoint(folder), rank=0)
    assert [v.data_ptr() for s in resumed.optimizer.state.values() for v in s.values()] == (
        state_pointers
    )


def test_a_snapshot_is_a_copy_and_a_reused_staging_snapshot_equals_a_fresh_one(
    single_thread,
) -> None:
    """The Saver snapshots into one HostStaging for the whole run: each snapshot must equal a
    fresh copy of the live state at its step (not an alias of the live tensors, not stale
    values of the previous save), and reuse the same buffers."""
    step = _step(seed=0)
    _train(step, 1)
    staging = HostStaging()
    run = {"DFLASH_TRAIN__SEED": 0}
    first = snapshot([step], step=1, cursor=PackCursor(0, 1), seed=0, run=run, staging=staging)
    first_weights = {k: v.clone() for k, v in first["drafter"].items()}
    pointers = [v.data_ptr() for v in first["drafter"].values()]
    _train(step, 1)  # the live state moves on: an alias would move with it
    assert all(torch.equal(first["drafter"][k], v) for k, v in first_weights.items())
    second = snapshot([step], step=2, cursor=PackCursor(0, 2), seed=0, run=run, staging=staging)
    fresh = _state(step, 2)
    assert [v.data_ptr() for v in second["drafter"].values()] == pointers  # reused
    for name, saved in fresh["drafter"].items():
        assert torch.equal(second["drafter"][name], saved), name
    for got, want in zip(second["optimizer"], fresh["optimizer"], strict=True):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want if torch.is_tensor(want[k]))
    assert not any(torch.equal(first_weights[k], v) for k, v in second["drafter"].items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_snapshot_copies_through_page_locked_buffers_exactly() -> None:
    """On a GPU the large buffers are page-locked (cudaHostRegister) and the copies, enqueued
    non-blocking, are complete when snapshot returns (it waits on the stream)."""
    staging = HostStaging()
    try:
        big = torch.randn(1 << 19, device="cuda")  # 2 MiB fp32: above the page-locking size
        small = torch.randn(16, device="cuda")
        for _ in range(2):  # the second round reuses the buffers
            big.mul_(2)
            host_big, host_small = staging.copy("big", big), staging.copy("small", small)
            staging.wait(big.device)
            assert host_big.is_pinned() and not host_small.is_pinned()
            assert torch.equal(host_big, big.cpu()) and torch.equal(host_small, small.cpu())
    finally:
        staging.close()


def test_checkpoints_keep_the_newest_k_and_refuse_foreign_files(tmp_path: Path) -> None:
    step = _step(seed=0)
    for n in (1, 2, 3):
        write_checkpoint(tmp_path, _state(step, n), keep=2)
    assert [n for n, _ in list_checkpoints(tmp_path)] == [2, 3]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-00000002",
        "step-00000003",
    ]
    run = json.loads((tmp_path / "checkpoints" / "step-00000003" / "run.json").read_text())
    assert run["cursor"] == {"epoch": 0, "index": 3, "seed": 0}
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a dflash_async training state"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(FileNotFoundError, match="missing"):
        load_checkpoint(tmp_path / "missing")


def test_failed_checkpoint_write_leaves_the_previous_one_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = _step(seed=0)
    write_checkpoint(tmp_path, _state(step, 1), keep=1)

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        write_checkpoint(tmp_path, _state(step, 2), keep=1)
    ((n, folder),) = list_checkpoints(tmp_path)
    assert n == 1 and sorted(p.name for p in folder.parent.iterdir()) == ["step-00000001"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_atomic_write_respects_the_umask(tmp_path: Path, umask: int) -> None:
    """Checkpoints, exports, data caches and jsonl results are readable like any other output
    (tempfile would make them 0600/0700, unreadable to the group)."""
    from dflash_async.eval.regenerate import write_jsonl

    previous = os.umask(umask)
    try:
        write_checkpoint(tmp_path / "run", _state(_step(seed=0), 1), keep=1)
        export_drafter(_fake_drafter(CONFIG), CONFIG, tmp_path / "run" / "drafter")
        write_jsonl([{"a": 1}], tmp_path / "run" / "results.jsonl")
    finally:
        os.umask(previous)
    for path in (tmp_path / "run").rglob("*"):
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, path


def test_the_real_drafter_has_exactly_the_servable_names_and_shapes(tmp_path: Path) -> None:
    from dflash_async.model.drafter import DFlashDrafter

    drafter = DFlashDrafter(CONFIG)
    shapes = {name: tuple(p.shape) for name, p in drafter.named_parameters()}
    assert shapes == expected_weight_shapes(CONFIG)
    config, tensors = load_drafter_export(export_drafter(drafter, CONFIG, tmp_path / "d"))
    assert config == CONFIG and tensors.keys() == shapes.keys()


def test_space_estimates_bound_the_checkpoint_and_export_written(tmp_path: Path) -> None:
    step = _step(seed=0)
    _train(step, 1)  # AdamW's moments exist: the state is its full size
    _, size = write_checkpoint(tmp_path, _state(step, 1), keep=1)
    config = step.objective.drafter.config
    export = export_drafter(dict(step.objective.drafter.named_parameters()), config, tmp_path / "d")
    exported = sum(p.stat().st_size for p in export.iterdir())
    assert size <= checkpoint_bytes(step) <= 2 * size
    assert exported <= export_bytes(config) <= 3 * exported


def test_output_space_check_reads_the_real_free_space_and_counts_existing_checkpoints(
    tmp_path: Path,
) -> None:
    step = _step(seed=0)
    config = step.objective.drafter.config
    out = tmp_path / "out"  # not created yet: the free space of its parent's filesystem
    needed = check_output_space(out, step, config, keep=2)  # the real shutil.disk_usage
    assert needed == 3 * checkpoint_bytes(step) + export_bytes(config) < free_bytes(out)
    with pytest.raises(SettingsError, match=r"KEEP_CHECKPOINTS=2\)$") as error:
        check_output_space(out, step, config, keep=2, free=lambda _: needed - 1)
    assert "\n" not in str(error.value) and "for 2+1 checkpoints and the export" in str(error.value)
    write_checkpoint(out, _state(step, 1), keep=2)  # a resumed run's: one of the 2+1 is there
    assert check_output_space(out, step, config, keep=2) == needed - checkpoint_bytes(step)
