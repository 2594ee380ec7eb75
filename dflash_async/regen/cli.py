"""The `regenerate` command: its arguments, the checks before any model loads, and the run loop.

Bad input is found before any work, for exit 2 with one line: arguments, the input (every record
of this machine's part is read once: bad records, an empty input), `--output` being or lying inside
the input, an output folder holding something else or another regeneration, the server not
answering, the target folder. Then the engine's answers go to the shard writer in input order,
with a `regenerate_progress` event every --progress-every seconds. A signal (KeyboardInterrupt
here, from the CLI's handler) or an error flushes the records done, so a re-run resumes there.
Imports stay light at the top (argparse only): the CLI builds its parser from `add_arguments`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ON_ERROR = ("fail", "skip")
_FLUSH_EVERY_S = 1.0  # a SIGKILL loses at most this much work (a flush costs two fsyncs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dflash_async.data.formats import ASSISTANT_TURNS as TURNS
    from dflash_async.regen.corpus import Split
    from dflash_async.usage import positive_int

    def batch_size(text: str) -> int | None:
        return None if text == "auto" else positive_int(text)

    def split(text: str) -> Split:
        try:
            return Split.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    add = parser.add_argument
    add(
        "--input",
        required=True,
        help="conversations as `run` reads them: a file, glob or folder of .jsonl(.gz), .json, "
        ".parquet or a datasets folder; OpenAI messages or ShareGPT conversations",
    )
    add("--output", required=True, help="a folder: shard-NNNNN.jsonl files and a manifest")
    engine = parser.add_mutually_exclusive_group(required=True)
    engine.add_argument(
        "--target",
        help="in process: local HF model folder or cached model id (with its vision tower and "
        "processor when the input holds image records)",
    )
    engine.add_argument("--server", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    add("--model", help="the server's model name (default: the first it lists)")
    add(
        "--devices",
        "--device",
        default="auto",
        help="in process: the devices, one target replica and worker thread each, e.g. "
        "cuda:0,cuda:1 or 0,1 or cpu (auto: every visible GPU, else the CPU)",
    )
    add(
        "--batch-size",
        type=batch_size,
        default="auto",
        help="in process: prompts a batch (auto: as many as fit in the free GPU memory; 32 on CPU)",
    )
    add(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="in process: compile the decode step (default: on a GPU)",
    )
    add("--concurrency", type=positive_int, default=64, help="server: requests in flight")
    add("--timeout", type=float, default=600.0, help="server: seconds per request")
    add("--retries", type=int, default=5, help="server: retries of a failed request")
    add("--max-new-tokens", type=positive_int, default=512)
    add("--sample", action="store_true", help="sample instead of greedy")
    add("--temperature", type=float, default=1.0, help="with --sample (greedy is temperature 0)")
    add("--seed", type=int, default=0, help="sampling seed (the server gets seed + record number)")
    add(
        "--enable-thinking",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="passed to the chat template (Qwen3's thinking mode)",
    )
    add("--chat-template-kwargs", default="{}", help="more template arguments, a JSON object")
    add("--role-map", default="", help="extra role aliases, e.g. gpt=assistant,human=user")
    add(
        "--turns",
        choices=TURNS,
        default="all",
        help="all: every assistant turn, each given the earlier regenerated ones; last: the last",
    )
    add("--shard", type=split, default=Split(), help="this machine's part i/n of the corpus")
    add("--records-per-shard", type=positive_int, default=1000)
    add(
        "--on-error",
        choices=_ON_ERROR,
        default="fail",
        help="a record the server rejects: fail the run (exit 2) or skip it (counted)",
    )
    add("--progress-every", type=float, default=5.0, help="seconds between progress events")
    add("--limit", type=positive_int, default=None, help="only the first N records of the input")


def _template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from dflash_async.usage import UsageError

    try:
        extra = json.loads(args.chat_template_kwargs)
    except ValueError as error:
        raise UsageError(f"--chat-template-kwargs is not JSON: {error}") from None
    if not isinstance(extra, dict):
        raise UsageError("--chat-template-kwargs must be a JSON object")
    return {"enable_thinking": args.enable_thinking, **extra}


def _role_map(args: argparse.Namespace) -> dict[str, str]:
    from dflash_async.data.formats import DEFAULT_ROLE_MAP, parse_role_map
    from dflash_async.usage import UsageError

    try:
        return DEFAULT_ROLE_MAP | parse_role_map(args.role_map)
    except ValueError as error:
        raise UsageError(f"--role-map: {error}") from None


def _check_arguments(args: argparse.Namespace) -> None:
    from dflash_async.usage import UsageError

    if args.sample and not args.temperature > 0:  # `not >`: NaN is refused too
        raise UsageError(f"--temperature must be > 0 with --sample, got {args.temperature}")
    if not args.timeout > 0 or args.retries < 0 or not args.progress_every > 0:
        raise UsageError("--timeout and --progress-every must be > 0, --retries >= 0")
    if args.model and not args.server:
        raise UsageError("--model names the --server's model; the in-process engine has --target")


def main(args: argparse.Namespace) -> Path:
    """Run the command; returns the output folder. UsageError/DataError/TargetError: exit 2."""
    from dflash_async.log import get_logger
    from dflash_async.regen.corpus import Corpus, check_output_outside_input
    from dflash_async.regen.shards import read_progress
    from dflash_async.usage import check_writable_folder

    _check_arguments(args)
    sampling = _sampling(args)
    corpus = Corpus.open(
        args.input,
        role_map=_role_map(args),
        split=args.shard,
        limit=args.limit,
    )
    output = Path(args.output)
    check_output_outside_input(args.input, output)
    check_writable_folder(output, argument="--output")
    devices = _devices(args)
    scan = corpus.scan()
    total, fingerprint = scan.records, scan.fingerprint
    if total == 0:
        from dflash_async.data.formats import DataError

        part = f" (part {args.shard})" if args.shard.count > 1 else ""
        raise DataError(f"--input {args.input!r}{part} has no records to regenerate")
    log = get_logger("dflash_async")
    model_name = _served_model(args)
    identity = _identity(
        args, corpus, sampling, total=total, fingerprint=fingerprint, model_name=model_name
    )
    progress = read_progress(output, identity)
    if progress.complete:
        log.info("regenerate_completed", output=str(output), records=total, already_done=True)
        return output
    engine = _engine(
        args, sampling, model_name=model_name, devices=devices, images=scan.with_images > 0
    )
    _drive(
        engine,
        corpus,
        output,
        identity=identity,
        progress=progress,
        total=total,
        args=args,
        log=log,
    )
    return output


def _sampling(args: argparse.Namespace) -> Any:
    from dflash_async.regen.engines import Sampling

    return Sampling(
        max_new_tokens=args.max_new_tokens,
        greedy=not args.sample,
        temperature=args.temperature,
        seed=args.seed,
        turns=args.turns,
        template_kwargs=_template_kwargs(args),
    )


def _devices(args: argparse.Namespace) -> list[Any]:
    """--devices as torch devices (exit 2 for one that does not exist here or appears twice)."""
    if args.server:
        return []
    import torch

    from dflash_async.runtime.devices import parse_device
    from dflash_async.usage import UsageError

    text = args.devices.strip().lower()
    if text == "auto":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    devices = [parse_device(item, setting="--device") for item in text.split(",") if item.strip()]
    if not devices or len(set(devices)) < len(devices):
        raise UsageError(f"--devices {args.devices!r}: name each device once, e.g. cuda:0,cuda:1")
    return devices


def _served_model(args: argparse.Namespace) -> str | None:
    if not args.server:
        return None
    from dflash_async.regen.engines import ServerEngine

    return args.model or ServerEngine.served_model(args.server, timeout_s=min(args.timeout, 30))


def _identity(
    args: argparse.Namespace,
    corpus: Any,
    sampling: Any,
    *,
    total: int,
    fingerprint: str,
    model_name: str | None,
) -> dict[str, Any]:
    """What the output depends on: a re-run resumes only when all of it is the same."""
    return {
        "input_fingerprint": fingerprint,
        "records": total,
        "shard": str(args.shard),
        "limit": args.limit,
        "role_map": dict(sorted(corpus.role_map.items())),
        "records_per_shard": args.records_per_shard,
        "engine": "server" if args.server else "in_process",
        "model": model_name if args.server else str(args.target),
        "max_new_tokens": sampling.max_new_tokens,
        "greedy": sampling.greedy,
        # what the answers were generated at: greedy is temperature 0 (as sent to a server),
        # whatever --temperature says without --sample
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "seed": sampling.seed,
        "turns": sampling.turns,
        "template_kwargs": dict(sampling.template_kwargs),
    }


def _engine(
    args: argparse.Namespace,
    sampling: Any,
    *,
    model_name: str | None,
    devices: list[Any],
    images: bool,
) -> Any:
    """The server engine, or the target loaded here: the wrapper whole with its processor when
    the records hold images (the processor first: a target without one is exit 2 before any
    weights load), else the language model."""
    if args.server:
        from dflash_async.regen.engines import ServerEngine

        return ServerEngine(
            args.server,
            model=model_name,
            sampling=sampling,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            retries=args.retries,
        )
    from dflash_async.regen.engines import InProcessEngine
    from dflash_async.targets import multimodal
    from dflash_async.targets.loading import (
        default_target_dtype,
        load_target,
        load_target_tokenizer,
    )

    # TargetError (a missing folder, no image processor, no vision tower): exit 2
    processor = None
    if images:
        processor = multimodal.load_target_processor(args.target)
        models = [
            multimodal.load_multimodal_target(
                args.target, device=device, dtype=default_target_dtype(device)
            )
            for device in devices
        ]
    else:
        models = [load_target(args.target, device=device) for device in devices]
    return InProcessEngine(
        models,
        load_target_tokenizer(args.target),
        sampling=sampling,
        batch_size=args.batch_size,
        compile=args.compile,
        processor=processor,
    )


def _drive(
    engine: Any,
    corpus: Any,
    output: Path,
    *,
    identity: dict[str, Any],
    progress: Any,
    total: int,
    args: argparse.Namespace,
    log: Any,
) -> None:
    """Every remaining record through the engine into the shards (see the module docstring)."""
    from dflash_async.data.formats import DataError
    from dflash_async.regen.shards import ShardWriter

    writer = ShardWriter(
        output, identity=identity, records_per_shard=args.records_per_shard, progress=progress
    )
    meter = _Meter(
        total=total,
        done=writer.done,
        every_s=args.progress_every,
        log=log,
        probe=getattr(engine, "progress", None),  # the in-process engine's work mid-batch
        max_new_tokens=args.max_new_tokens,
    )
    take_warnings = getattr(engine, "take_warnings", list)
    log.info(
        "regenerate_started",
        output=str(output),
        records=total,
        resumed_at=writer.done,
        engine=identity["engine"],
        model=identity["model"],
    )
    last_flush, shards = time.monotonic(), len(progress.shards)
    outcomes = engine.outcomes(corpus.conversations(skip=writer.done))
    try:
        for outcome in outcomes:
            if outcome is not None and outcome.error is not None:
                where = outcome.conversation.where
                if args.on_error == "fail":
                    raise DataError(
                        f"{where}: the server rejected it: {outcome.error} "
                        "(--on-error skip skips such records)"
                    )
                log.warning("regenerate_record_skipped", where=where, error=outcome.error)
            if outcome is not None:
                writer.add(outcome.record)
                meter.count(outcome)
            if len(progress.shards) > shards:
                shards = len(progress.shards)
                log.info(
                    "regenerate_shard_written",
                    file=progress.shards[-1]["file"],
                    records_done=writer.done,
                )
            if time.monotonic() - last_flush > _FLUSH_EVERY_S:
                writer.flush()
                last_flush = time.monotonic()
            for warning in take_warnings():
                log.warning("regenerate_context_exceeded", **warning)
            meter.maybe_log()
        writer.finish()
        if len(progress.shards) > shards:
            log.info(
                "regenerate_shard_written",
                file=progress.shards[-1]["file"],
                records_done=writer.done,
            )
    finally:
        outcomes.close()  # now, not at garbage collection: the server's workers stop
        writer.flush()  # the records done stay done (a no-op after finish)
        writer.close()
    log.info(
        "regenerate_completed",
        output=str(output),
        records=total,
        shards=len(progress.shards),
        skipped=progress.skipped,
        **meter.rates(),
    )


class _Meter:
    """Records and tokens per second of this invocation (records already in the shards are not
    counted), and the ETA of the rest. `probe` (the in-process engine's `progress`) gives the
    tokens decoded so far, batches in flight included: a window's records all come out at its
    end, so until then the tokens are the work shown, and the ETA is bounded by
    --max-new-tokens per record (`eta_basis`)."""

    def __init__(
        self,
        *,
        total: int,
        done: int,
        every_s: float,
        log: Any,
        probe: Callable[[], dict[str, int]] | None = None,
        max_new_tokens: int = 0,
    ) -> None:
        self.total, self.done, self.every_s, self.log = total, done, every_s, log
        self.new_records = self.new_tokens = 0
        self.started = self.last = time.monotonic()
        self.probe, self.max_new_tokens = probe, max_new_tokens

    def count(self, outcome: Any) -> None:
        self.done += 1
        self.new_records += 1
        self.new_tokens += outcome.new_tokens

    def rates(self) -> dict[str, float]:
        seconds = max(time.monotonic() - self.started, 1e-9)
        per_s = self.new_records / seconds
        return {
            "seconds": round(seconds, 3),
            "new_tokens": self.new_tokens,
            "records_per_s": round(per_s, 3),
            "new_tokens_per_s": round(self.new_tokens / seconds, 1),
        }

    def maybe_log(self) -> None:
        if time.monotonic() - self.last < self.every_s:
            return
        self.last = time.monotonic()
        rates = self.rates()
        left = self.total - self.done
        work: dict[str, Any] = {}
        eta, basis = None, None
        if rates["records_per_s"]:
            eta, basis = round(left / rates["records_per_s"], 1), "records"
        if self.probe is not None:
            decoded = self.probe()["tokens_decoded"]
            per_s = decoded / max(time.monotonic() - self.started, 1e-9)
            work = {"tokens_decoded": decoded, "decoded_tokens_per_s": round(per_s, 1)}
            if eta is None and per_s > 0 and self.max_new_tokens:
                eta = round(left * self.max_new_tokens / per_s, 1)
                basis = "at most --max-new-tokens per record"
        self.log.info(
            "regenerate_progress",
            records_done=self.done,
            records_total=self.total,
            **work,
            eta_s=eta,
            eta_basis=basis,
            **rates,
        )
