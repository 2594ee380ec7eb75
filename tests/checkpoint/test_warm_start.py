"""Warm starts (DFLASH_DRAFTER__INIT, checkpoint/warm.py), CPU, tiny target: a new run starts
from an export's weights (bf16, cast to the fp32 masters) or a checkpoint's fp32 weights exactly,
in every drafter, with a fresh optimizer and schedule, then trains and exports as usual; a
drafter of another shape exits 2 naming the field before any training; a resume wins over INIT.

The weights "at step 0" are read where the pipeline hands the built, initialized drafters to
`train_steps`, before its first step.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs
from tiny_run import tiny_env, tiny_inputs

from dflash_async.checkpoint.export import export_drafter, load_drafter_export
from dflash_async.checkpoint.state import list_checkpoints, load_checkpoint
from dflash_async.errors import SettingsError
from dflash_async.log import get_logger
from dflash_async.pipeline import run as pipeline
from dflash_async.settings import Settings
from dflash_async.settings.env import load_settings

RUN_DEADLINE_S = 60  # a run here takes ~1-3 s; past this it hangs
SOURCE_STEPS = 2


def settings_for(inputs: dict[str, str], output_dir: Path, **env: str) -> Settings:
    base = tiny_env(inputs, output_dir) | {
        "DFLASH_TRAIN__MAX_STEPS": str(SOURCE_STEPS),
        "DFLASH_TRAIN__SAVE_EVERY": "0",
        "DFLASH_EVAL__AT_END": "false",
    }
    return load_settings(base | env)


async def train(settings: Settings) -> tuple[int, list[dict], list[list[dict]]]:
    """Run; return (exit code, log events, every drafter's named weights at step 0)."""
    at_start: list[list[dict[str, torch.Tensor]]] = []
    real_train_steps = pipeline.train_steps

    async def recorded(runners, *args, **kwargs) -> int:
        # CPU drafters: their start-up jobs are done when the pipeline gets here.
        at_start.extend([named_weights(r.step) for r in runners])
        return await real_train_steps(runners, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "train_steps", recorded)
        with capture_logs() as events, anyio.fail_after(RUN_DEADLINE_S):
            code = await pipeline.run(settings, get_logger("test"))
    return code, events, at_start


def named_weights(step) -> dict[str, torch.Tensor]:
    named = step.objective.drafter.named_parameters()
    return {n.replace("_orig_mod.", ""): p.detach().clone() for n, p in named}


def assert_weights_equal(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        assert found[name].dtype == torch.float32, name
        assert torch.equal(found[name], tensor), name


def events_named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["event"] == name]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_inputs(tmp_path_factory.mktemp("warm"))


@pytest.fixture(scope="module")
def source(inputs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run: its final checkpoint and its export (the warm starts' sources)."""
    out = tmp_path_factory.mktemp("source") / "out"
    code, _, _ = anyio.run(train, settings_for(inputs, out))
    assert code == 0
    return out


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def zlab_layout(export: Path, folder: Path) -> Path:
    """The same drafter as another tool writes it: `model.`-prefixed names, the embedding and
    lm_head included, a config.json with only the flat rope_theta and top-level block size."""
    tensors = {f"model.{k}": v for k, v in load_file(str(export / "model.safetensors")).items()}
    hidden = tensors["model.norm.weight"].shape[0]
    config = json.loads((export / "config.json").read_text())
    vocab = config["vocab_size"]
    tensors["model.embed_tokens.weight"] = torch.zeros(vocab, hidden, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.zeros(vocab, hidden, dtype=torch.bfloat16)
    for key in ("rope_parameters", "dtype"):
        config.pop(key)
    config["dflash_config"].pop("block_size")
    config["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.anyio
@pytest.mark.parametrize("layout", ["ours", "zlab"])
async def test_warm_start_from_an_export_starts_at_its_weights_cast_to_fp32_then_trains_and_exports(
    inputs: dict[str, str], source: Path, tmp_path: Path, layout: str
) -> None:
    export = source / "drafter"
    if layout == "zlab":
        export = zlab_layout(export, tmp_path / "zlab")
    _, stored = load_drafter_export(export)
    code, events, at_start = await train(
        settings_for(inputs, tmp_path / "out", DFLASH_DRAFTER__INIT=str(export))
    )
    assert code == 0
    (initialized,) = events_named(events, "drafter_initialized")
    assert initialized["path"] == str(export) and initialized["kind"] == "export"
    assert initialized["tensors"] == len(stored) and initialized["stored_dtype"] == "bfloat16"
    (weights,) = at_start
    assert_weights_equal(weights, {k: v.float() for k, v in stored.items()})
    # Then a run like any other: all its steps, from step 1, and an export of trained weights.
    assert [e["step"] for e in events_named(events, "step")] == [1, 2]
    assert not events_named(events, "resumed")
    _, trained = load_drafter_export(tmp_path / "out" / "drafter")
    assert any(not torch.equal(trained[k], stored[k]) for k in stored)


@pytest.mark.anyio
async def test_warm_start_from_a_checkpoint_gives_every_drafter_its_fp32_weights_exactly_and_a_fresh_schedule(
    inputs: dict[str, str], source: Path, tmp_path: Path
) -> None:
    ((step, folder),) = list_checkpoints(source)
    saved = load_checkpoint(folder)["drafter"]
    # An extension: more steps than the source's (another run identity), two drafter workers.
    settings = settings_for(
        inputs,
        tmp_path / "out",
        DFLASH_TRAIN__MAX_STEPS="4",
        DFLASH_DRAFTER__INIT=str(folder),
        DFLASH_PIPELINE__DRAFTER_DEVICES="cpu,cpu",
    )
    code, events, at_start = await train(settings)
    assert code == 0 and step == SOURCE_STEPS
    (initialized,) = events_named(events, "drafter_initialized")
    assert (initialized["kind"], initialized["drafters"]) == ("checkpoint", 2)
    assert initialized["stored_dtype"] == "float32"
    assert len(at_start) == 2
    for weights in at_start:
        assert_weights_equal(weights, saved)
    assert [e["step"] for e in events_named(events, "step")] == [1, 2, 3, 4]
    ((_, last),) = list_checkpoints(tmp_path / "out")
    state = load_checkpoint(last)
    # A fresh optimizer and schedule: 4 steps of this run, not the source's 2 more.
    assert state["step"] == state["schedule_step"] == 4
    assert {int(s["step"]) for s in state["optimizer"]} == {4}
    assert (tmp_path / "out" / "drafter" / "model.safetensors").is_file()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["export", "checkpoint"])
async def test_warm_start_from_a_drafter_of_other_num_layers_exits_2_naming_the_field(
    inputs: dict[str, str], source: Path, tmp_path: Path, kind: str
) -> None:
    if kind == "export":  # a 2-layer export; this run builds 1 layer
        config, tensors = load_drafter_export(source / "drafter")
        deeper = replace(config, num_hidden_layers=2)
        tensors |= {k.replace("layers.0.", "layers.1."): v.clone() for k, v in tensors.items()}
        init, layers = export_drafter(tensors, deeper, tmp_path / "deeper"), "1"
    else:  # the 1-layer checkpoint; this run builds 2 layers
        init, layers = list_checkpoints(source)[-1][1], "2"
    settings = settings_for(
        inputs, tmp_path / "out", DFLASH_DRAFTER__INIT=str(init), DFLASH_DRAFTER__NUM_LAYERS=layers
    )
    with pytest.raises(
        SettingsError,
        match=r"^DFLASH_DRAFTER__INIT=.*: its drafter has "
        r"num_hidden_layers=\d, this run's has \d \(see "
        r"DFLASH_DRAFTER__NUM_LAYERS\)",
    ) as error:
        await train(settings)
    assert "\n" not in str(error.value)  # the CLI prints it as one line, exit 2
    assert not (tmp_path / "out" / "checkpoints").exists()  # refused before any training


@pytest.mark.anyio
async def test_init_is_ignored_with_a_log_line_when_the_folder_resumes_a_checkpoint(
    inputs: dict[str, str], source: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    shutil.copytree(source, out)
    ((_, folder),) = list_checkpoints(out)
    code, events, at_start = await train(
        settings_for(inputs, out, DFLASH_DRAFTER__INIT=str(source / "drafter"))
    )
    assert code == 0
    (ignored,) = events_named(events, "drafter_init_ignored")
    assert ignored["path"] == str(source / "drafter") and ignored["resumed"] == str(folder)
    assert not events_named(events, "drafter_initialized")
    assert [e["step"] for e in events_named(events, "resumed")] == [SOURCE_STEPS]
    saved = load_checkpoint(folder)["drafter"]
    _, exported = load_drafter_export(source / "drafter")
    assert any(not torch.equal(exported[k].float(), saved[k]) for k in saved)  # tells them apart
    (weights,) = at_start  # the checkpoint's fp32 weights, not the export's bf16 ones
    assert_weights_equal(weights, saved)


def test_an_init_folder_without_weights_is_refused_at_settings_load(
    inputs: dict[str, str], tmp_path: Path
) -> None:
    env = tiny_env(inputs, tmp_path / "out")
    with pytest.raises(
        SettingsError,
        match=r"^DFLASH_DRAFTER__INIT='.*nowhere': the folder .* "
        "does not exist",
    ):
        load_settings(env | {"DFLASH_DRAFTER__INIT": str(tmp_path / "nowhere")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        SettingsError,
        match=r"is neither a drafter export \(config.json \+ "
        r"model.safetensors\) nor a training checkpoint \(training_state.pt\)",
    ):
        load_settings(env | {"DFLASH_DRAFTER__INIT": str(tmp_path / "empty")})


@pytest.mark.parametrize(
    ("field", "value", "setting"),
    [
        ("target_layer_ids", (0, 1, 2), "DFLASH_TARGET__NUM_FEATURES"),
        ("mask_token_id", 3, "DFLASH_DRAFTER__MASK_TOKEN_ID"),
        ("block_size", 16, "DFLASH_TRAIN__BLOCK_SIZE"),
        ("intermediate_size", 8, "DFLASH_TARGET__PATH"),
    ],
)
def test_a_drafter_differing_in_one_field_is_refused_naming_that_field_and_its_setting(
    source: Path, field: str, value: object, setting: str
) -> None:
    from dflash_async.checkpoint.warm import check_same_drafter  # here: the module is new

    ours, _ = load_drafter_export(source / "drafter")
    theirs = replace(ours, **{field: value})
    assert getattr(theirs, field) != getattr(ours, field)
    with pytest.raises(SettingsError, match=rf"its drafter has {field}=.*\(see {setting}"):
        check_same_drafter(theirs, ours, path=source / "drafter")
    check_same_drafter(ours, ours, path=source / "drafter")  # the same drafter passes


# DeepSpec's checkpoints: `Qwen3DSparkModel.save_pretrained` writes the drafter's tensors under
# our export's names plus the frozen embedding and lm_head, and a config without dflash_config.


def dspark_export(folder: Path) -> Path:
    """A tiny random DSpark drafter's export (vanilla Markov head, confidence head on it)."""
    from conftest import TinySpec, randomize_, tiny_config

    from dflash_async.model.kinds.dspark.drafter import DSparkDrafter

    config = replace(tiny_config(TinySpec(block_size=5)), kind="dspark", markov_rank=8)
    drafter = DSparkDrafter(config)
    randomize_(drafter, seed=11)
    return export_drafter(drafter, config, folder)


def deepspec_layout(export: Path, folder: Path, **extra: torch.Tensor) -> Path:
    """The same drafter as DeepSpec saves it: its tensors plus embed_tokens and lm_head of the
    target's shape (and `extra`), a config with the top-level fields only."""
    tensors = load_file(str(export / "model.safetensors"))
    config = json.loads((export / "config.json").read_text())
    shape = (config["vocab_size"], config["hidden_size"])
    tensors["embed_tokens.weight"] = torch.ones(shape, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.ones(shape, dtype=torch.bfloat16)
    tensors |= extra
    config.pop("dflash_config")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_deepspec_dspark_checkpoint_warm_starts_without_its_frozen_tensors(
    tmp_path: Path,
) -> None:
    from dflash_async.checkpoint.warm import read_init_weights
    from dflash_async.model.kinds.dspark.drafter import DSparkDrafter

    config, stored = load_drafter_export(dspark_export(tmp_path / "ours"))
    folder = deepspec_layout(tmp_path / "ours", tmp_path / "deepspec")
    init = read_init_weights(folder, config)
    assert init.kind == "export" and init.tensors.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.equal(init.tensors[name], tensor), name
    DSparkDrafter(config).load_state_dict(init.tensors, strict=True)  # every parameter, no more


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"markov_head.bias": torch.zeros(3)}, "tensor markov_head.bias is not in this run's"),
        ({"lm_head.weight": torch.zeros(7, 32)}, r"frozen lm_head.weight has shape \[7, 32\]"),
        (
            {"confidence_head.proj.weight": torch.zeros(1, 3)},
            r"tensor confidence_head.proj.weight has shape \[1, 3\]",
        ),
    ],
)
def test_a_deepspec_checkpoint_with_an_unexpected_tensor_or_shape_is_refused_naming_it(
    tmp_path: Path, extra: dict[str, torch.Tensor], named: str
) -> None:
    from dflash_async.checkpoint.warm import read_init_weights

    config, _ = load_drafter_export(dspark_export(tmp_path / "ours"))
    extra = {k: v.to(torch.bfloat16) for k, v in extra.items()}
    folder = deepspec_layout(tmp_path / "ours", tmp_path / "deepspec", **extra)
    with pytest.raises(SettingsError, match=named):
        read_init_weights(folder, config)
