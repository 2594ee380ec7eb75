"""The speculators-convention export of a DSpark drafter (checkpoint/speculators.py) and the
`export` command that writes it (checkpoint/formats.py), CPU, tiny random drafters.

The config is compared field by field with the contract written from speculators 0.9.0's
`DSparkSpeculatorConfig` (and its DFlash base, the greedy proposal and the verifier config): the
anchor-first slots are said with `sample_from_anchor: true`, the target layers are counted as
speculators counts them (+1). Reading the export back gives the config it was written from and
the tensors bit for bit. What the reader refuses: the older B+1 convention, a reduced draft
vocabulary, a missing head tensor, an unknown tensor. The check against speculators' own classes
is tests/eval/test_speculators_reference.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TinySpec, randomize_, tiny_config
from external_check_kit import rewrite_export
from safetensors.torch import load_file

from dflash_async.__main__ import main
from dflash_async.checkpoint.export import export_drafter, load_drafter_export
from dflash_async.checkpoint.formats import FORMATS, write_export
from dflash_async.checkpoint.speculators import (
    export_speculators,
    load_speculators_export,
    speculators_config_json,
)
from dflash_async.model.kinds import kind_of

VARIANTS = {
    "vanilla": dict(markov_rank=8),
    "gated": dict(markov_rank=8, markov_head_type="gated"),
    "confidence_on_h": dict(markov_rank=8, confidence_head_with_markov=False),
    "no_markov": dict(markov_rank=0, confidence_head_with_markov=False),
    "no_confidence": dict(markov_rank=8, confidence_head=False),
}


def dspark(**fields):
    """(config, random drafter) of a tiny DSpark drafter, block 5, with `fields`."""
    config = replace(tiny_config(TinySpec(block_size=5)), kind="dspark", **fields)
    drafter = kind_of("dspark").make_drafter(config)
    randomize_(drafter, seed=3)
    return config, drafter


def test_the_config_is_exactly_speculators_dspark_contract() -> None:
    config, _ = dspark(markov_rank=8, markov_head_type="gated")
    written = speculators_config_json(
        config, verifier="Qwen/Qwen3-8B", verifier_architectures=["Q"]
    )
    layer = written.pop("transformer_layer_config")
    assert written == {
        "speculators_model_type": "dspark",
        "speculators_version": "0.9.0",
        "architectures": ["DSparkSpeculator"],
        "draft_vocab_size": 97,  # the full target vocabulary: no t2d / d2t
        "block_size": 5,  # B inputs [anchor, MASK x 4] ...
        "sample_from_anchor": True,  # ... every one drafts: the anchor's slot too
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "target_hidden_size": None,
        "mask_token_id": 96,
        "sliding_window_non_causal": False,
        "markov_rank": 8,
        "markov_head_type": "gated",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "num_target_layers": 8,
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 5,  # = block_size: B drafts per round
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Q"]},
        },
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }
    assert layer["model_type"] == "qwen3" and layer["vocab_size"] == 97
    assert layer["num_hidden_layers"] == 2 and layer["layer_types"] == ["full_attention"] * 2
    assert (layer["hidden_size"], layer["head_dim"], layer["intermediate_size"]) == (32, 16, 64)
    assert (layer["num_attention_heads"], layer["num_key_value_heads"]) == (4, 2)
    assert layer["tie_word_embeddings"] is False and layer["attention_bias"] is False


@pytest.mark.parametrize("name", VARIANTS)
def test_the_export_reads_back_to_its_config_and_the_same_bf16_tensors(
    name: str, tmp_path: Path
) -> None:
    config, drafter = dspark(**VARIANTS[name])
    export_speculators(drafter, config, tmp_path / "out", verifier=None)
    read_config, tensors = load_speculators_export(tmp_path / "out")
    assert read_config == config
    params = dict(drafter.named_parameters())
    assert tensors.keys() == params.keys()  # the backbone and head names, nothing else
    for name_, tensor in tensors.items():  # each name holds its own parameter (not a swap)
        assert torch.equal(tensor, params[name_].detach().to(torch.bfloat16)), name_


def test_the_command_rewrites_a_run_export_with_the_same_tensors(tmp_path: Path, capsys) -> None:
    config, drafter = dspark(markov_rank=8)
    export_drafter(drafter, config, tmp_path / "drafter")
    verifier = tmp_path / "target"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    argv = ["export", "--drafter", str(tmp_path / "drafter"), "--format", "speculators"]
    code = main([*argv, "--out", str(tmp_path / "spec"), "--verifier", str(verifier)])
    assert code == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["format"] == "speculators"
    written = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert written["speculators_config"]["verifier"] == {
        "name_or_path": str(verifier),
        "architectures": ["Qwen3ForCausalLM"],
    }
    assert same_tensors(tmp_path / "spec", tmp_path / "drafter")


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two exports hold the same tensor names with bit-equal values."""
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_every_format_of_the_table_reads_back_the_same_tensors(tmp_path: Path) -> None:
    config, drafter = dspark(markov_rank=8)
    tensors = {k: v.detach().to(torch.bfloat16) for k, v in drafter.named_parameters()}
    for name in FORMATS:
        write_export(tensors, config, tmp_path / name, format=name, verifier="t")
    assert same_tensors(tmp_path / "default", tmp_path / "speculators")


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (dict(kind="dflash"), "no speculators format for a 'dflash' drafter"),
        (dict(kind="dspark", layer_types=("sliding_attention", "full_attention")), "full"),
        (dict(kind="dspark", is_causal=True), "full bidirectional"),
        (dict(kind="dspark", input_embedding_scale=2.0), "input_embedding_scale"),
    ],
)
def test_what_the_format_cannot_carry_exactly_is_refused(fields: dict, says: str) -> None:
    config = replace(tiny_config(TinySpec(block_size=5)), sliding_window=8, **fields)
    with pytest.raises(ValueError, match=says):
        speculators_config_json(config, verifier=None)


def test_the_default_reader_refuses_a_speculators_export_naming_it(tmp_path: Path) -> None:
    config, drafter = dspark(markov_rank=8)
    export_speculators(drafter, config, tmp_path / "out", verifier=None)
    with pytest.raises(ValueError, match="a vLLM speculators export"):
        load_drafter_export(tmp_path / "out")


def test_the_command_refuses_a_dflash_export_in_one_line(tmp_path: Path, capsys) -> None:
    config = tiny_config(TinySpec(block_size=5))
    drafter = kind_of("dflash").make_drafter(config)
    export_drafter(drafter, config, tmp_path / "drafter")
    argv = ["export", "--drafter", str(tmp_path / "drafter"), "--format", "speculators"]
    assert main([*argv, "--out", str(tmp_path / "spec")]) == 2
    assert "no speculators format for a 'dflash' drafter" in capsys.readouterr().err
    assert not (tmp_path / "spec").exists()


@pytest.mark.parametrize(
    ("mutant", "says"),
    [
        (dict(config={"sample_from_anchor": False, "block_size": 6}), "sample_from_anchor"),
        (dict(config={"draft_vocab_size": 50}), "reduced vocabulary"),
        (dict(config={"speculators_model_type": "dflash"}), "speculators_model_type"),
        (dict(drop="confidence_head."), "missing drafter tensors"),
    ],
    ids=["slots_shifted_by_one", "reduced_vocab", "other_model_type", "confidence_head_missing"],
)
def test_the_reader_refuses_what_is_not_this_convention(
    mutant: dict, says: str, tmp_path: Path
) -> None:
    config, drafter = dspark(markov_rank=8)
    folder = export_speculators(drafter, config, tmp_path / "out", verifier=None)
    with pytest.raises(ValueError, match=says):
        load_speculators_export(rewrite_export(folder, **mutant))
