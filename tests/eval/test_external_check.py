"""eval/external_check.py, the half of every external check that needs no external checkout.

Our recorded decoding of a demo prompt is speculative_decode's own (same tokens and acceptance
lengths as an unrecorded run) and logs exactly the drafts each round verified, one per round
(compared with a plain drafter whose draft() is wrapped on the instance); the checkout's commit is
git's HEAD, None where there is none; the JSON line names the project in its commit and tau keys,
keeps the keys' order and exits 1 on a bad key or a differing prompt; and each check script parses
the shared arguments and refuses a folder that is not its project's checkout before loading
anything.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from external_check_kit import check_script, tiny_export

from dflash_async.eval.external_check import (
    Tally,
    check_parser,
    check_setup,
    checkout_commit,
    recorded_decoding,
    reported,
)
from dflash_async.eval.speculative import DFlashBlockDrafter, speculative_decode
from dflash_async.targets.tiny import ensure_tiny_target

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
SCRIPTS = {"zlab_check": "--zlab", "deepspec_check": "--deepspec"}
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def setup_and_args(tmp_path_factory):
    folder = ensure_tiny_target(tmp_path_factory.mktemp("external") / "cache")
    export = tiny_export(
        folder, tmp_path_factory.mktemp("export") / "drafter", block_size=5, fields={}
    )
    parser = check_parser("a check", project="other")
    argv = ["--other", "x", "--drafter", str(export), "--target", str(folder), "--num-prompts", "2"]
    args = parser.parse_args([*argv, "--max-new-tokens", str(MAX_NEW_TOKENS)])
    return check_setup(args), args


def unrecorded_decoding(setup, prompt):
    """speculative_decode with a plain drafter, its drafts logged by a wrapper on the instance."""
    # the context never holds more than the prompt, the new tokens and one block
    room = len(prompt) + MAX_NEW_TOKENS + setup.config.block_size
    drafter = DFlashBlockDrafter(
        setup.drafter, setup.config, setup.embed, setup.lm_head, max_context=room
    )
    log, draft = [], drafter.draft

    def logged_draft(anchor_token, anchor_position):
        drafts = draft(anchor_token, anchor_position)
        log.append(drafts.tolist())
        return drafts

    drafter.draft = logged_draft
    spec = speculative_decode(
        setup.target,
        drafter,
        prompt,
        layer_ids=setup.config.target_layer_ids,
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=setup.eos,
    )
    return spec, log


def test_the_setup_holds_the_heldout_prompts_and_the_sorted_stop_tokens(setup_and_args):
    setup, args = setup_and_args
    assert len(setup.prompts) == args.num_prompts and all(setup.prompts)
    assert setup.eos and setup.eos == sorted(setup.eos)
    assert setup.config.block_size == 5


def test_our_recorded_decoding_logs_each_rounds_drafts_and_decodes_as_unrecorded(setup_and_args):
    setup, _ = setup_and_args
    for prompt in setup.prompts:
        spec, log = recorded_decoding(setup, prompt, max_new_tokens=MAX_NEW_TOKENS)
        assert (spec, log) == unrecorded_decoding(setup, prompt)
        assert len(log) == len(spec.accepted_lengths) > 0
        assert all(len(drafts) == setup.config.block_size - 1 for drafts in log)


def test_the_checkout_commit_is_heads_and_none_without_a_checkout(tmp_path):
    assert checkout_commit(tmp_path / "absent") is None
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "m"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True)
    assert checkout_commit(tmp_path) == head.stdout.decode().strip()


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_check_takes_the_shared_arguments_and_refuses_a_folder_not_its_checkout(
    name, tmp_path, capsys
):
    main = check_script(name).main
    with pytest.raises(SystemExit) as shown:
        main(["--help"])
    assert shown.value.code == 0
    usage = capsys.readouterr().out
    shared = ("--drafter", "--target", "--num-prompts", "--max-new-tokens", "--cache-dir")
    for flag in (SCRIPTS[name], *shared):
        assert flag in usage, flag
    with pytest.raises(SystemExit, match="there"):
        main([SCRIPTS[name], str(tmp_path), "--drafter", str(tmp_path / "none")])


def test_the_report_names_the_project_and_exits_1_on_a_difference_or_a_bad_key(tmp_path, capsys):
    args = check_parser("a check", project="other").parse_args(
        ["--other", str(tmp_path / "absent"), "--drafter", "export"]
    )
    tally = Tally()
    tally.add(0, {"tokens": True}, [3, 1], rounds=2)
    tally.add(1, {"tokens": True}, [2], rounds=1)
    assert reported(args, theirs=1.0, info={}, keys_ok=True, tally=tally) == 0
    assert reported(args, theirs=1.0, info={}, keys_ok=False, tally=tally) == 1
    tally.add(2, {"tokens": False}, [], rounds=0)
    assert reported(args, theirs=1.0, info={}, keys_ok=True, tally=tally) == 1
    lines = capsys.readouterr().out.splitlines()
    expected = {
        "other_commit": None,
        "drafter": "export",
        "architecture": "float",
        "loading_info": {},
        "prompts": 2,
        "rounds": 3,
        "other_tau": (2.0 + 2.0) / 2,  # [3, 1] and [2]: 2 tokens a round each
        "differences": [],
    }
    report = json.loads(lines[0])
    assert report == expected and list(report) == list(expected)  # the keys in this order
    assert json.loads(lines[2])["differences"] == [{"prompt": 2, "tokens": False}]
