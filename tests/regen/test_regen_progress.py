"""`regenerate` shows its work before a window's records come out (tokens decoded, their rate,
an ETA) and warns when answers may run past the model's context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_async.regen.cli import _Meter
from dflash_async.regen.corpus import Conversation
from dflash_async.regen.engines import InProcessEngine, Sampling
from dflash_async.targets.loading import load_target, load_target_tokenizer
from dflash_async.targets.tiny import ensure_tiny_target

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_intra_op_thread")]
MAX_NEW = 24


class Events:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, **fields})

    warning = info


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    folder: Path = ensure_tiny_target(tmp_path_factory.mktemp("tiny"))
    return load_target(folder, device=torch.device("cpu")), load_target_tokenizer(folder)


def engine_for(tiny: tuple, **kwargs: Any) -> InProcessEngine:
    model, tokenizer = tiny
    sampling = Sampling(max_new_tokens=MAX_NEW, template_kwargs={"enable_thinking": False})
    return InProcessEngine(
        [model], tokenizer, sampling=sampling, batch_size=4, tick_s=0.001, **kwargs
    )


def conversations(n: int) -> list[Conversation]:
    records = [{"messages": [{"role": "user", "content": f"Count to {i}."}]} for i in range(n)]
    return [Conversation(i, f"in.jsonl:{i + 1}", r) for i, r in enumerate(records)]


def test_tokens_decoded_grow_while_no_record_is_done_yet(tiny: tuple) -> None:
    """One window of 8 records: every record comes out at its end; the tokens show the work."""
    engine = engine_for(tiny, window_batches=2)
    seen_before_first_record = []
    for outcome in engine.outcomes(conversations(8)):
        if outcome is not None:
            break
        seen_before_first_record.append(engine.progress()["tokens_decoded"])
    assert seen_before_first_record[-1] > 0
    assert seen_before_first_record == sorted(seen_before_first_record)
    # at most 8 rows x MAX_NEW steps; a batch runs until its longest row ends
    assert engine.progress()["tokens_decoded"] <= 8 * MAX_NEW


def test_the_progress_line_has_tokens_a_rate_and_an_eta_before_any_record() -> None:
    log, decoded = Events(), {"tokens_decoded": 0}
    meter = _Meter(
        total=50, done=0, every_s=0.0, log=log, probe=lambda: decoded, max_new_tokens=100
    )
    meter.started -= 10.0  # 10 s in: about 50 tokens/s
    decoded["tokens_decoded"] = 500
    meter.maybe_log()
    line = log.events[-1]
    assert (line["records_done"], line["tokens_decoded"]) == (0, 500)
    assert line["decoded_tokens_per_s"] > 0
    # 50 records x at most 100 tokens at the decode rate
    assert line["eta_s"] == pytest.approx(50 * 100 / line["decoded_tokens_per_s"], rel=1e-2)
    assert line["eta_basis"] == "at most --max-new-tokens per record"


def test_answers_that_may_run_past_the_context_are_warned_about(tiny: tuple) -> None:
    engine = engine_for(tiny, window_batches=1)
    assert engine.context == 4096  # the tiny target's max_position_embeddings
    list(engine.outcomes(conversations(2)))
    assert engine.take_warnings() == []
    engine.context = 30  # shorter than a prompt + MAX_NEW: every prompt may run past it
    list(engine.outcomes(conversations(2)))
    (warning,) = engine.take_warnings()
    assert (warning["prompts"], warning["of_prompts"], warning["context"]) == (2, 2, 30)
    assert "--max-new-tokens" in warning["hint"] and engine.take_warnings() == []


def test_a_greedy_regenerations_identity_records_temperature_0() -> None:
    import argparse
    from types import SimpleNamespace

    from dflash_async.regen.cli import _identity, _sampling, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--target", "t", "--input", "in.jsonl", "--output", "out"]
    corpus = SimpleNamespace(role_map={})
    for argv, temperature in ((base, 0.0), ([*base, "--sample", "--temperature", "0.7"], 0.7)):
        args = parser.parse_args(argv)
        identity = _identity(
            args, corpus, _sampling(args), total=1, fingerprint="f", model_name=None
        )
        assert (identity["temperature"], identity["greedy"]) == (temperature, temperature == 0)
