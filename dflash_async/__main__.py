"""Command line: run | launch | settings | bench | regenerate | eval | calibrate | export | report,
and --version.

One contract for every command (usage.py): bad input (a setting, argument, file, device or output
path) -> one line `error: ...` on stderr naming it, exit 2, no traceback, checked before any model
is loaded; an internal error -> exit 1 with the traceback in the log as a `<command>_failed` event;
130/143 after SIGINT/SIGTERM, with one `<command>_interrupted` log line and no traceback (`run`
stops at its safe points, pipeline/shutdown.py; every other command unwinds at once, keeping what
it had completed: its writes are atomic). Logs go to stdout as JSON lines (a console renderer on a
TTY), so in JSON mode every stdout line is JSON; `settings` prints its JSON document and nothing
else there.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from contextlib import nullcontext
from typing import Any

from dflash_async import __version__
from dflash_async.errors import SettingsError
from dflash_async.pipeline.shutdown import Shutdown  # light (anyio): handlers before imports
from dflash_async.settings import Settings
from dflash_async.settings.env import Sources, load_with_sources
from dflash_async.usage import (
    ArgumentParser,
    UsageError,
    check_writable_file,
    check_writable_folder,
)


def _is_user_error(error: BaseException) -> bool:
    """Bad settings or inputs (exit 2). Imported here, not at the top: target.loading loads
    transformers (~3 s), which a bad-settings exit should not wait for."""
    from dflash_async.checkpoint.space import NoSpaceError  # the output path's disk is full
    from dflash_async.data.samples import DataError
    from dflash_async.targets.resolve import TargetError

    return isinstance(error, SettingsError | DataError | TargetError | UsageError | NoSpaceError)


def _configure_logging(fmt: str = "auto", level: str = "info") -> None:
    from dflash_async.log import configure_logging

    configure_logging(fmt, level)  # type: ignore[arg-type]


def _settings_and_logging() -> tuple[Settings, Sources]:
    settings, sources = load_with_sources()
    check_writable_folder(settings.output_dir, argument="DFLASH_OUTPUT_DIR")
    _configure_logging(settings.log.format, settings.log.level)
    return settings, sources


def cmd_run(args: argparse.Namespace) -> int:
    """Train a drafter with the DFLASH_* settings (no settings: the CPU demo)."""
    from dflash_async.pipeline.shutdown import Shutdown  # light: signals handled before imports

    shutdown = Shutdown()
    with shutdown.installed():
        import anyio

        from dflash_async.log import get_logger
        from dflash_async.pipeline.distributed import rank_info_from_env
        from dflash_async.pipeline.run import run
        from dflash_async.runlog.record import RunRecord, open_run_record
        from dflash_async.settings.resolved import resolve, visible_gpu_count

        settings, sources = _settings_and_logging()
        log = get_logger("dflash_async")
        resolution = resolve(settings, sources, visible_gpus=visible_gpu_count())
        options = {"use_uvloop": True} if sys.platform != "win32" else {}
        with contextlib.ExitStack() as stack:
            record = stack.enter_context(  # several nodes: rank 0 alone keeps the run's record
                open_run_record(
                    output_dir=settings.output_dir,
                    settings_dict=settings.public_dict(),
                    log_settings=settings.log,
                    log=log,
                )
                if rank_info_from_env(os.environ).is_writer
                else nullcontext(RunRecord(settings.output_dir, 0))
            )

            def close_record(code: int) -> None:  # a signal's exit skips the unwinding below
                record.exit_code = code
                stack.close()

            shutdown.before_exit = close_record
            log.info("settings_loaded", **settings.public_dict())
            (log.warning if resolution.warnings else log.info)(
                "settings_resolved", **resolution.event_fields()
            )
            main = functools.partial(
                run, settings, log, shutdown=shutdown, on_accepted=record.accept
            )  # record.accept: the folder is written once the resume point is checked
            record.exit_code = anyio.run(main, backend="asyncio", backend_options=options)
        return record.exit_code


def cmd_launch(args: argparse.Namespace) -> int:
    """Run `run` on this node's ranks through torch's launcher (torchrun's options), with one
    exit code for the node (pipeline/launch.py)."""
    _configure_logging()
    from dflash_async.log import get_logger
    from dflash_async.pipeline.launch import launch  # torch.distributed: only here

    return launch(args.rest, log=get_logger("dflash_async"))


def cmd_settings(args: argparse.Namespace) -> int:
    """Print the effective settings as JSON; paths absent on this machine are warned about on
    stderr, not fatal (any preset can be inspected anywhere)."""
    from dflash_async.settings.env import missing_paths
    from dflash_async.settings.resolved import resolve, visible_gpu_count

    settings, sources = load_with_sources(check_paths=False)  # a model id: its snapshot folder
    missing = missing_paths(settings.target, settings.data, settings.eval, drafter=settings.drafter)
    print(json.dumps(settings.public_dict(), indent=2, default=str))
    for name, problem in missing.items():
        print(f"warning: {name}: {problem}", file=sys.stderr)
    resolution = resolve(settings, sources, visible_gpus=visible_gpu_count())
    for origin, names in resolution.sources.items():
        print(f"from {origin}: {', '.join(names)}", file=sys.stderr)
    print(f"devices: {resolution.devices}", file=sys.stderr)
    for note in resolution.notes:
        print(f"note: {note}", file=sys.stderr)
    for warning in resolution.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


BENCHES = ("drafter", "target", "data", "packing", "regen")
# the research benchmarks that left the package: their old `bench` names and scripts
MOVED_BENCHES = {
    "attention": "attention_bench.py",
    "graphs": "graph_bench.py",
    "linear": "linear_bench.py",
    "optimizer": "optimizer_bench.py",
}


def bench_name(text: str) -> str:
    """argparse type of `bench`'s name: a moved research benchmark's name fails saying where."""
    if text in MOVED_BENCHES:
        script = f"benchmarks/research/{MOVED_BENCHES[text]}"
        raise argparse.ArgumentTypeError(
            f"bench {text} moved out of the package: run python {script} [options]"
        )
    return text


def cmd_bench(args: argparse.Namespace) -> int:
    """Benchmarks of the product's builders: `bench drafter|target|data|packing|regen [...]` (the
    GPU drafter step, the target's forward paths, the data stages, the packer, in-process
    regeneration). The research benchmarks are scripts in benchmarks/research/."""
    _configure_logging()
    if args.what == "drafter":
        from dflash_async.bench.drafter_bench import main
    elif args.what == "target":
        from dflash_async.bench.target_bench import main
    elif args.what == "data":
        from dflash_async.bench.data_bench import main
    elif args.what == "regen":
        from dflash_async.bench.regen_bench import main
    else:
        from dflash_async.bench.packing_bench import main
    main(args.rest)
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    """Regenerate the assistant turns of a corpus with the target: an OpenAI-compatible server
    (--server) or in process (--target), into resumable shard files (regen/cli.py)."""
    from dflash_async.regen.cli import main as regenerate

    _configure_logging()
    path = regenerate(args)  # bad input: UsageError / DataError / TargetError before any work
    print(json.dumps({"event": "regenerated", "path": str(path)}), flush=True)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Plots, summary table and report.html from run folders or JSON logs (several side by side)."""
    from dflash_async.runlog.command import report

    print(json.dumps({"event": "report_written", "path": str(report(args.runs, args.out))}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Acceptance length of a drafter export by greedy speculative decoding."""
    from dflash_async.eval.harness import build_parser as eval_parser
    from dflash_async.eval.harness import main, read_prompts
    from dflash_async.runtime.devices import parse_device

    options = eval_parser().parse_args(args.rest)  # bad options: one line, exit 2
    parse_device(options.device, setting="--device")
    if options.prompts:
        read_prompts(options.prompts)  # a bad prompts file fails before the target is loaded
    if options.results:
        check_writable_file(options.results, argument="--results")
    _configure_logging()
    return main(args.rest)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit a DSpark drafter's confidence-head temperature on held-out prompts, into its export."""
    from dflash_async.eval.calibrate_command import build_parser as calibrate_parser
    from dflash_async.eval.calibrate_command import main
    from dflash_async.runtime.devices import parse_device

    options = calibrate_parser().parse_args(args.rest)  # bad options: one line, exit 2
    parse_device(options.device, setting="--device")
    _configure_logging()
    return main(args.rest)


def cmd_export(args: argparse.Namespace) -> int:
    """Rewrite a drafter export in another format (the vLLM speculators convention)."""
    from dflash_async.checkpoint.formats import build_parser as export_parser
    from dflash_async.checkpoint.formats import run_export

    options = export_parser().parse_args(args.rest)  # bad options: one line, exit 2
    check_writable_folder(os.path.dirname(os.path.abspath(options.out)), argument="--out")
    _configure_logging()
    try:
        result = run_export(options)
    except (OSError, ValueError) as error:  # a bad export or a format it cannot take
        raise UsageError(f"--drafter {options.drafter}: {error}") from error
    print(json.dumps(result), flush=True)
    return 0


def settings_epilog(width: int = 100) -> str:
    """`run --help` and `settings --help`: every DFLASH_* variable with the first sentence of its
    description (docs/training.md has them in full)."""
    from dflash_async.settings.env import setting_descriptions

    lines = [
        "settings: DFLASH_* environment variables, optionally from a preset file",
        "(DFLASH_ENV_FILE=settings/x.env); `python -m dflash_async settings` prints the",
        "effective values and where they came from; docs/training.md describes them.",
        "",
    ]
    for name, description in setting_descriptions().items():
        first = " ".join(description.split()).split(". ")[0].rstrip(".")
        room = width - len(name) - 2
        lines.append(f"{name}  {first if len(first) <= room else first[: room - 3] + '...'}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m dflash_async", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dflash_async {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    settings_help = {"epilog": settings_epilog(), "formatter_class": argparse.RawTextHelpFormatter}
    sub.add_parser("run", help=cmd_run.__doc__, description=cmd_run.__doc__, **settings_help)
    sub.choices["run"].set_defaults(fn=cmd_run)
    # every option (even -h) goes to torchrun's parser (pipeline/launch.py)
    launch = sub.add_parser("launch", help=cmd_launch.__doc__, prefix_chars="+", add_help=False)
    launch.add_argument("rest", nargs=argparse.REMAINDER, help="torchrun's options (launch --help)")
    launch.set_defaults(fn=cmd_launch)
    sub.add_parser(
        "settings", help=cmd_settings.__doc__, description=cmd_settings.__doc__, **settings_help
    ).set_defaults(fn=cmd_settings)
    bench = sub.add_parser("bench", help=cmd_bench.__doc__)
    bench.add_argument("what", type=bench_name, choices=BENCHES)
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark")
    bench.set_defaults(fn=cmd_bench)
    from dflash_async.regen.cli import add_arguments as regenerate_arguments  # argparse only

    regenerate_arguments(regen := sub.add_parser("regenerate", help=cmd_regenerate.__doc__))
    regen.set_defaults(fn=cmd_regenerate)
    # every option (even -h) goes to the eval harness's own parser
    ev = sub.add_parser("eval", help=cmd_eval.__doc__, prefix_chars="+", add_help=False)
    ev.add_argument("rest", nargs=argparse.REMAINDER, help="options of eval (eval --help)")
    ev.set_defaults(fn=cmd_eval)
    cal = sub.add_parser("calibrate", help=cmd_calibrate.__doc__, prefix_chars="+", add_help=False)
    cal.add_argument("rest", nargs=argparse.REMAINDER, help="options of calibrate (--help)")
    cal.set_defaults(fn=cmd_calibrate)
    exp = sub.add_parser("export", help=cmd_export.__doc__, prefix_chars="+", add_help=False)
    exp.add_argument("rest", nargs=argparse.REMAINDER, help="options of export (export --help)")
    exp.set_defaults(fn=cmd_export)
    from dflash_async.runlog.command import add_arguments  # argparse only: no matplotlib yet

    add_arguments(rep := sub.add_parser("report", help=cmd_report.__doc__))
    rep.set_defaults(fn=cmd_report)
    return parser


def _first_leaf(error: BaseException) -> BaseException:
    """The original error inside (nested) exception groups from task groups."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


class _RaisingShutdown(Shutdown):
    """`run`'s signal handling for commands without safe points: the first SIGINT or SIGTERM
    raises KeyboardInterrupt in the main thread, so the command unwinds through its `with` and
    `finally` blocks (an atomic write in progress is discarded) and main() maps it to 130/143.
    Shutdown keeps the rest: a second SIGINT exits 130 at once, a second SIGTERM is ignored (the
    stop is under way), the previous handlers come back afterwards."""

    def request(self, signum: int) -> None:
        first = not self.requested
        super().request(signum)
        if first:  # KeyboardInterrupt, not an Exception: `except Exception` must not swallow it
            raise KeyboardInterrupt(self.reason)


def main(argv: list[str] | None = None) -> int:
    stop = _RaisingShutdown()
    with stop.installed():  # `run` installs its own Shutdown inside cmd_run, over this one
        args = build_parser().parse_args(argv)
        try:
            return _outcome(args)
        except KeyboardInterrupt:
            return _interrupted(args.command, stop)


def _outcome(args: argparse.Namespace) -> int:
    """The command's exit code; its errors mapped by the contract (2 bad input, 1 internal). An
    interrupt, even inside an exception group, propagates as a KeyboardInterrupt."""
    try:
        return args.fn(args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:
        leaf = _first_leaf(error)
        if isinstance(leaf, KeyboardInterrupt):
            raise leaf from None
        if _is_user_error(leaf):
            print(f"error: {leaf}", file=sys.stderr)
            return 2
        return _internal_error(args.command, leaf)


def _interrupted(command: str, stop: Shutdown) -> int:
    """130 (SIGINT) or 143 (SIGTERM) with one log event and no traceback. A KeyboardInterrupt
    without a recorded signal (raised by code, or a Ctrl-C outside the handlers) counts as SIGINT."""
    code, reason = (stop.exit_code, stop.reason) if stop.requested else (130, "SIGINT")
    _command_log().info(f"{command}_interrupted", reason=reason, exit_code=code)
    return code


def _command_log() -> Any:
    """The CLI's logger, set up first if the command failed or stopped before doing so (a
    message must never come out as raw text on stdout)."""
    import logging

    from dflash_async.log import HANDLER_NAME, get_logger

    if not any(h.get_name() == HANDLER_NAME for h in logging.getLogger().handlers):
        _configure_logging()
    return get_logger("dflash_async")


def _internal_error(command: str, error: BaseException) -> int:
    """Exit 1 with the traceback as one log event (JSON on stdout, or console text on a TTY)."""
    _command_log().error(f"{command}_failed", exc_info=error)
    return 1


if __name__ == "__main__":
    sys.exit(main())
