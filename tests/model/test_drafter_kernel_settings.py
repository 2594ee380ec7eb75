"""The drafter's kernel settings: flex_attention options parse from the environment, unknown ones
fail at load with one line naming the setting, the objective carries them unchanged, and the
flex backend and CE kernel resolve to what can run where the drafter is."""

from __future__ import annotations

import pytest

from dflash_async.errors import SettingsError
from dflash_async.settings.env import load_settings

NO_FILE = {"DFLASH_ENV_FILE": "none"}


def test_flex_kernel_options_parse_from_json_and_default_to_torchs() -> None:
    assert load_settings(NO_FILE).train.flex_kernel_options == {}
    assert load_settings(NO_FILE).train.flex_autotune is False
    train = load_settings(
        NO_FILE
        | {
            "DFLASH_TRAIN__FLEX_KERNEL_OPTIONS": '{"USE_TMA": true, "bwd_BLOCK_M1": 64}',
            "DFLASH_TRAIN__FLEX_AUTOTUNE": "true",
        }
    ).train
    assert train.flex_kernel_options == {"USE_TMA": True, "bwd_BLOCK_M1": 64}
    assert train.flex_autotune is True
    tiles = {"DFLASH_TRAIN__FLEX_KERNEL_OPTIONS": '{"fwd_BLOCK_M": 64, "PRESCALE_QK": "0"}'}
    assert load_settings(NO_FILE | tiles).train.flex_kernel_options["PRESCALE_QK"] == "0"


def test_flex_backend_defaults_to_auto_and_is_not_chosen_through_kernel_options() -> None:
    assert load_settings(NO_FILE).train.flex_backend == "auto"
    flash = {"DFLASH_TRAIN__FLEX_BACKEND": "flash"}
    assert load_settings(NO_FILE | flash).train.flex_backend == "flash"
    with pytest.raises(SettingsError, match="FLEX_BACKEND"):
        load_settings(NO_FILE | {"DFLASH_TRAIN__FLEX_KERNEL_OPTIONS": '{"BACKEND": "FLASH"}'})
    with pytest.raises(SettingsError, match=r"FLEX_BACKEND|flex_backend"):
        load_settings(NO_FILE | {"DFLASH_TRAIN__FLEX_BACKEND": "cute"})


def test_flex_backend_auto_is_triton_off_the_gpu_and_flash_there_is_refused() -> None:
    """flash-attn-4 runs only on a CUDA GPU: auto falls back to torch's Triton kernels, and an
    explicit flash says why it cannot run instead of failing inside the first compile."""
    import torch

    from dflash_async.model.attention_rule import flash_unavailable_reason, resolve_flex_backend

    cpu = torch.device("cpu")
    assert "CUDA" in flash_unavailable_reason(cpu)
    assert resolve_flex_backend("auto", device=cpu) == "triton"
    assert resolve_flex_backend("triton", device=cpu) == "triton"
    with pytest.raises(ValueError, match="flex_backend='flash': it needs a CUDA GPU"):
        resolve_flex_backend("flash", device=cpu)


def test_flash_backend_refuses_triton_tuning_and_auto_keeps_triton_for_it() -> None:
    """Kernel options and autotuning tune torch's Triton kernels: asking for them with flash is
    an error (they would be dropped silently), and auto then stays on Triton."""
    import torch

    from dflash_async.model.attention_rule import resolve_flex_backend

    cpu = torch.device("cpu")
    assert resolve_flex_backend("auto", device=cpu, tunes_triton=True) == "triton"
    with pytest.raises(ValueError, match="tune torch's Triton kernels"):
        resolve_flex_backend("flash", device=cpu, tunes_triton=True)


def test_an_unknown_flex_option_is_one_line_naming_the_setting() -> None:
    with pytest.raises(SettingsError) as error:
        load_settings(NO_FILE | {"DFLASH_TRAIN__FLEX_KERNEL_OPTIONS": '{"USE_TMAX": true}'})
    message = str(error.value)
    assert "DFLASH_TRAIN__FLEX_KERNEL_OPTIONS" in message and "USE_TMAX" in message
    assert "\n" not in message


def test_ce_kernel_defaults_to_auto_and_names_a_bad_choice() -> None:
    assert load_settings(NO_FILE).train.ce_kernel == "auto"
    assert (
        load_settings(NO_FILE | {"DFLASH_TRAIN__CE_KERNEL": "triton"}).train.ce_kernel == "triton"
    )
    with pytest.raises(SettingsError, match=r"CE_KERNEL|ce_kernel"):
        load_settings(NO_FILE | {"DFLASH_TRAIN__CE_KERNEL": "liger"})


def test_triton_ce_kernel_is_refused_off_the_gpu() -> None:
    """The Triton pass is GPU-only: an objective on the CPU asking for it fails at build."""
    import torch
    from conftest import TinySpec, tiny_config, tiny_drafter, tiny_target_weights

    from dflash_async.model.objective import DFlashObjective, ObjectiveConfig

    config = tiny_config(TinySpec())
    embed, lm_head = tiny_target_weights(config, seed=0, dtype=torch.float32)
    objective_config = ObjectiveConfig(
        block_size=config.block_size,
        num_anchors=4,
        mask_token_id=config.mask_token_id,
        gamma=4.0,
        ce_kernel="triton",
    )
    with pytest.raises(ValueError, match="CUDA"):
        DFlashObjective(objective_config, tiny_drafter(config, 0), embed, lm_head)


def test_conv_kernel_defaults_to_auto_and_names_a_bad_choice() -> None:
    assert load_settings(NO_FILE).train.conv_kernel == "auto"
    triton = {"DFLASH_TRAIN__CONV_KERNEL": "triton"}
    assert load_settings(NO_FILE | triton).train.conv_kernel == "triton"
    with pytest.raises(SettingsError, match=r"CONV_KERNEL|conv_kernel"):
        load_settings(NO_FILE | {"DFLASH_TRAIN__CONV_KERNEL": "cudnn"})


def test_dflash2_convolutions_take_the_reference_on_the_cpu_and_refuse_triton_there() -> None:
    """auto on the CPU is the torch reference (the drafter keeps block_causal_conv); asking for
    the Triton kernels there fails at build, naming the device."""
    import dataclasses

    import torch
    from conftest import TinySpec, tiny_config, tiny_target_weights

    from dflash_async.model.kinds.dflash2.drafter import DFlash2Drafter
    from dflash_async.model.kinds.dflash2.objective import DFlash2Objective
    from dflash_async.model.objective import ObjectiveConfig

    config = dataclasses.replace(tiny_config(TinySpec()), kind="dflash2")
    embed, lm_head = tiny_target_weights(config, seed=0, dtype=torch.float32)
    objective_config = ObjectiveConfig(
        block_size=config.block_size, num_anchors=4, mask_token_id=config.mask_token_id, gamma=4.0
    )
    drafter = DFlash2Drafter(config)
    objective = DFlash2Objective(objective_config, drafter, embed, lm_head)
    assert objective.conv_kernel == "compiled" and drafter.conv is None
    with pytest.raises(ValueError, match="conv_kernel='triton' needs the drafter on a CUDA"):
        DFlash2Objective(
            objective_config, DFlash2Drafter(config), embed, lm_head, conv_kernel="triton"
        )


def test_the_drafter_step_logs_the_kernels_it_chose(tmp_path) -> None:
    """The preflight line names the resolved choices: on the CPU the plain CE pass and the
    reference optimizer phase (flex attention forced into the spec, as a GPU run would pick it)."""
    import dataclasses

    import torch
    from structlog.testing import capture_logs
    from tiny_run import tiny_env, tiny_inputs

    from dflash_async.pipeline.specs import run_spec
    from dflash_async.pipeline.startup import drafter_config_for
    from dflash_async.stages.train import drafter_step_on

    inputs = tiny_inputs(tmp_path, records=4)
    spec = run_spec(load_settings(tiny_env(inputs)))
    config = drafter_config_for(spec.drafter, inputs["target"], False)
    step_spec = dataclasses.replace(spec.step, attention="flex")
    with capture_logs() as logs:
        step = drafter_step_on(
            torch.device("cpu"),
            step_spec,
            config,
            target_path=inputs["target"],
            rank=0,
            total_steps=10,
        )
    (line,) = [entry for entry in logs if entry["event"] == "drafter_kernels_chosen"]
    assert (line["attention"], line["flex_backend"], line["ce_kernel"], line["update"]) == (
        "flex",
        "triton",
        "compiled",
        "reference",
    )
    assert step.adamw is None


def test_flex_attention_on_cpu_drafters_is_a_settings_error(tmp_path) -> None:
    """flex_attention has no backward on a CPU: the border refuses it (exit 2), not the step."""
    from tiny_run import tiny_env, tiny_inputs

    from dflash_async.pipeline.specs import run_spec

    inputs = tiny_inputs(tmp_path, records=4)
    settings = load_settings(tiny_env(inputs) | {"DFLASH_TRAIN__ATTENTION": "flex"})
    with pytest.raises(SettingsError, match="DFLASH_TRAIN__ATTENTION=flex needs GPU drafters"):
        run_spec(settings)


def test_flash_resolved_objective_keeps_full_precision_attention_on_triton_or_refuses_it() -> None:
    """flash-attn-4 takes bf16/fp16 only. With flash resolved (set by hand here: the CPU never
    resolves it), bf16 attention (the step's autocast) gets the FLASH backend; full-precision
    attention gets torch's Triton kernels under auto and a clear error when flash was asked for."""
    import dataclasses

    import torch
    from conftest import TinySpec, tiny_config, tiny_drafter, tiny_target_weights

    from dflash_async.model.objective import DFlashObjective, ObjectiveConfig

    config = tiny_config(TinySpec())
    embed, lm_head = tiny_target_weights(config, seed=0, dtype=torch.float32)
    objective_config = ObjectiveConfig(
        block_size=config.block_size,
        num_anchors=4,
        mask_token_id=config.mask_token_id,
        gamma=4.0,
        attention="flex",
    )
    objective = DFlashObjective(objective_config, tiny_drafter(config, 0), embed, lm_head)
    assert objective.flex_backend == "triton" and objective._flex_options_for_this_call() == {}
    objective.flex_backend = "flash"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert objective._flex_options_for_this_call() == {"BACKEND": "FLASH"}
    assert objective._flex_options_for_this_call() == {}  # the tiny drafter is fp64; auto: Triton
    objective.config = dataclasses.replace(objective_config, flex_backend="flash")
    with pytest.raises(ValueError, match=r"bf16 or fp16 attention, not torch\.float64"):
        objective._flex_options_for_this_call()


def test_flex_meets_heads_smaller_than_its_kernels_take_auto_as_sdpa_and_explicit_as_exit_2() -> (
    None
):
    """A tiny target's heads (llama2.c's stories260K: 8 dimensions) are below what
    flex_attention compiles: auto on GPU drafters becomes sdpa with a log line, an explicit flex
    is SettingsError naming the setting, and heads of 16 keep flex."""
    from data_samples import EventLog

    from dflash_async.pipeline.specs import fit_attention, run_spec
    from dflash_async.targets.packed.dense import FLEX_MIN_HEAD_DIM

    log = EventLog()

    def spec(**values):
        settings = load_settings(NO_FILE | {"DFLASH_TRAIN__MAX_STEPS": "1"} | values)
        return run_spec(settings, visible_gpus=1)

    auto = spec()
    assert auto.step.attention == "flex" and auto.attention_auto
    assert fit_attention(auto, head_dim=FLEX_MIN_HEAD_DIM, log=log) is auto
    assert fit_attention(auto, head_dim=8, log=log).step.attention == "sdpa"
    assert [e["event"] for e in log.events] == ["attention_fitted"]
    assert log.of("attention_fitted")["head_dim"] == 8
    flex = spec(DFLASH_TRAIN__ATTENTION="flex")
    assert fit_attention(flex, head_dim=16, log=EventLog()) is flex
    with pytest.raises(SettingsError, match=r"ATTENTION=flex: the drafter's heads have 8 dim"):
        fit_attention(flex, head_dim=8, log=EventLog())
    sdpa = spec(DFLASH_TRAIN__ATTENTION="sdpa")
    assert fit_attention(sdpa, head_dim=8, log=EventLog()) is sdpa
