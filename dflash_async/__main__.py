"""Command line: run | settings | bench | regenerate | eval. Exit codes: 0 ok, 1 internal error
(traceback in the log), 2 bad settings or inputs (one line, no traceback), 130/143 on a signal."""

from __future__ import annotations

import argparse
import functools
import json
import sys

from dflash_async.settings import Settings, SettingsError, load_settings


def _is_user_error(error: BaseException) -> bool:
    """Bad settings or inputs (exit 2). Imported here, not at the top: target.py loads
    transformers (~3 s), which a bad-settings exit should not wait for."""
    from dflash_async.data.samples import DataError
    from dflash_async.target.loading import TargetError

    return isinstance(error, SettingsError | DataError | TargetError)


def _settings_and_logging() -> Settings:
    from dflash_async.log import configure_logging

    settings = load_settings()
    configure_logging(settings.log.format, settings.log.level)
    return settings


def cmd_run(args: argparse.Namespace) -> int:
    """Train a drafter with the DFLASH_* settings (no settings: the CPU demo)."""
    from dflash_async.pipeline.shutdown import Shutdown  # light: signals handled before imports

    shutdown = Shutdown()
    with shutdown.installed():
        import anyio

        from dflash_async.log import get_logger
        from dflash_async.pipeline.run import run

        settings = _settings_and_logging()
        log = get_logger("dflash_async")
        log.info("settings_loaded", **settings.public_dict())
        options = {"use_uvloop": True} if sys.platform != "win32" else {}
        main = functools.partial(run, settings, log, shutdown=shutdown)
        return anyio.run(main, backend="asyncio", backend_options=options)


def cmd_settings(args: argparse.Namespace) -> int:
    """Print the effective settings as JSON."""
    print(json.dumps(load_settings().public_dict(), indent=2, default=str))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Benchmarks: `bench drafter|graphs [...]` (GPU step, graph checks) or `bench packing`."""
    if args.what == "drafter":
        from dflash_async.bench.drafter_bench import main

        main(args.rest)
    elif args.what == "graphs":
        from dflash_async.bench.graph_bench import main

        main(args.rest)
    else:
        from dflash_async.bench.packing_bench import bench_packing

        parser = argparse.ArgumentParser(prog="python -m dflash_async bench packing")
        parser.add_argument("--samples", type=int, default=100_000)
        parser.add_argument("--token-budget", type=int, default=49152)
        parser.add_argument("--max-len", type=int, default=3072)
        options = parser.parse_args(args.rest)
        result = bench_packing(options.samples, options.token_budget, options.max_len)
        print(json.dumps(result))
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    """Regenerate the assistant turns of a jsonl of conversations with the target."""
    from dflash_async.eval.regenerate import run_regenerate

    path = run_regenerate(
        args.input, args.output, args.target, args.device, args.max_new_tokens, args.batch_size,
        greedy=not args.sample, temperature=args.temperature, limit=args.limit,
    )  # fmt: skip
    print(json.dumps({"event": "regenerated", "path": str(path)}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Acceptance length of a drafter export by greedy speculative decoding."""
    from dflash_async.eval.harness import main
    from dflash_async.log import configure_logging

    configure_logging("auto", "info")
    return main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dflash_async", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help=cmd_run.__doc__).set_defaults(fn=cmd_run)
    sub.add_parser("settings", help=cmd_settings.__doc__).set_defaults(fn=cmd_settings)
    bench = sub.add_parser("bench", help=cmd_bench.__doc__)
    bench.add_argument("what", choices=("drafter", "graphs", "packing"))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark")
    bench.set_defaults(fn=cmd_bench)
    regen = sub.add_parser("regenerate", help=cmd_regenerate.__doc__)
    regen.add_argument("--input", required=True)
    regen.add_argument("--output", required=True)
    regen.add_argument("--target", required=True, help="local HF model folder")
    regen.add_argument("--device", default="cpu")
    regen.add_argument("--max-new-tokens", type=int, default=512)
    regen.add_argument("--batch-size", type=int, default=32)
    regen.add_argument("--sample", action="store_true", help="sample instead of greedy")
    regen.add_argument("--temperature", type=float, default=1.0)
    regen.add_argument("--limit", type=int, default=None)
    regen.set_defaults(fn=cmd_regenerate)
    # every option (even -h) goes to evaluate.main's own parser
    ev = sub.add_parser("eval", help=cmd_eval.__doc__, prefix_chars="+", add_help=False)
    ev.add_argument("rest", nargs=argparse.REMAINDER, help="options of eval (eval --help)")
    ev.set_defaults(fn=cmd_eval)
    return parser


def _first_leaf(error: BaseException) -> BaseException:
    """The original error inside (nested) exception groups from task groups."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:
        leaf = _first_leaf(error)
        if _is_user_error(leaf):
            print(f"error: {leaf}", file=sys.stderr)
            return 2
        if isinstance(leaf, KeyboardInterrupt):
            return 130
        from dflash_async.log import get_logger  # internal failure: exit 1, traceback in the log

        get_logger("dflash_async").error("run_failed", exc_info=leaf)
        return 1


if __name__ == "__main__":
    sys.exit(main())
