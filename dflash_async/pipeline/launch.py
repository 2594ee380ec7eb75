"""`launch`: one node's ranks of `run`, started by torch's own launcher (torchrun's parser,
LaunchConfig and elastic agent), with the node's outcome kept to the command contract.

Plain torchrun breaks the contract at its own exit: a signal ends it with a SignalException
traceback and exit 1, a rank's exit 2 becomes exit 1 with a ChildFailedError traceback. Here
the same agent starts the ranks (each `python -m dflash_async run`), forwards SIGINT/SIGTERM to
them (they stop at a step boundary and save; torchrun starts each in its own process group (setsid), so a
Ctrl-C reaches them once, through the agent) and waits; then the ranks' exits become one code:
every rank 0 -> 0; a rank's exit 2 -> 2 with that rank's `error:` line once on stderr; a signal
-> 130/143; otherwise 1 with one line naming the first failed rank. The ranks' stdout (their JSON
log lines) passes through; their stderr goes to torch's per-rank log files (`--log-dir`), which is
where the `error:` line is read from (every rank may print the same one).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.run import (
    config_from_args,
    determine_local_world_size,
    get_args_parser,
    parse_min_max_nnodes,
)

from dflash_async.usage import UsageError

PROG = "python -m dflash_async launch"
USAGE = f"{PROG} [torchrun's options: --nproc-per-node, --nnodes, --node-rank, ...] [-- run]"
RANK_COMMAND = ["run"]  # what every rank runs: the only command with several nodes
STOPPED = {130: "SIGINT", 143: "SIGTERM"}  # a rank's exit after a signal (pipeline/shutdown.py)
STDERR_ONLY = "2"  # torchrun's --redirects value for "stderr to the log files"


@dataclass(frozen=True)
class RankExit:
    """A rank that did not exit 0, in the order the agent saw the failures."""

    rank: int
    exit_code: int  # negative: killed by that signal
    error_line: str = ""  # its last `error: ...` stderr line, if any
    stderr: str = ""  # its stderr file


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    line: str = ""  # one line for stderr; none for 0 and for a signal


def outcome(failures: Sequence[RankExit]) -> Outcome:
    """The node's exit code from its failed ranks (the contract of __main__.py)."""
    if not failures:
        return Outcome(0)
    # Bad input first: when one rank's settings are bad, its peers end with peer_lost (1) or
    # the agent's SIGTERM (143), which are consequences, not the cause.
    for failure in failures:
        if failure.exit_code == 2 or failure.error_line:
            line = failure.error_line or f"error: rank {failure.rank} exited 2 (bad input)"
            return Outcome(2, line)
    first = failures[0]
    if first.exit_code in STOPPED:  # a signal reached the ranks directly (srun, kill)
        return Outcome(first.exit_code)
    how = (
        f"was killed by {_signal_name(-first.exit_code)}"
        if first.exit_code < 0
        else f"failed with exit code {first.exit_code}"
    )
    where = f"; its stderr: {first.stderr}" if _has_text(first.stderr) else ""
    return Outcome(1, f"error: rank {first.rank} {how} (its traceback is in its log{where})")


def error_line(stderr_file: str) -> str:
    """The last `error: ...` line a rank wrote on stderr ("" when none or no file)."""
    try:
        lines = Path(stderr_file).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line for line in reversed(lines) if line.startswith("error: ")), "")


def _has_text(path: str) -> bool:
    if not path:  # no file (Path("") would be the working folder)
        return False
    try:
        return Path(path).stat().st_size > 0
    except OSError:
        return False


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def launch(argv: Sequence[str], *, log: Any) -> int:
    """Parse torchrun's options, run the node's ranks, print the outcome's line; its code."""
    _route_agent_logs()
    config, entrypoint, entry_args, specs = launch_config(argv, log=log)
    try:
        elastic_launch(config, entrypoint)(*entry_args)
        failures: list[RankExit] = []
    except SignalException as stop:  # the agent has forwarded it and waited for the ranks
        code = 128 + int(stop.sigval)
        log.info("launch_interrupted", reason=_signal_name(int(stop.sigval)), exit_code=code)
        return code
    except ChildFailedError as failed:
        failures = rank_exits(failed.failures, specs.stderrs)
    result = outcome(failures)
    if result.line:
        print(result.line, file=sys.stderr)
    log_event = log.info if result.exit_code in (0, *STOPPED) else log.error
    log_event(
        "launch_finished",
        exit_code=result.exit_code,
        failures={f.rank: f.exit_code for f in failures},
    )
    return result.exit_code


def _route_agent_logs() -> None:
    """The agent's warnings (a rank failed, closing signals sent) as our log events on stdout:
    torch._logging gives `torch.distributed` a stderr handler of its own that does not
    propagate, and the contract keeps stderr for the one outcome line."""
    for name in ("torch.distributed.elastic", "torch.distributed.run"):
        agent = logging.getLogger(name)
        agent.handlers = list(logging.getLogger().handlers)  # ours (log.configure_logging)
        agent.propagate = False


def rank_exits(failures: Mapping[int, Any], stderrs: Mapping[int, str]) -> list[RankExit]:
    """torch's ProcessFailures (global rank -> failure, in the order the agent saw them)."""
    exits = []
    for rank, failure in failures.items():
        stderr = stderrs.get(failure.local_rank, "")
        exits.append(RankExit(rank, failure.exitcode, error_line(stderr), stderr))
    return exits


def launch_config(
    argv: Sequence[str], *, log: Any = None
) -> tuple[LaunchConfig, str, list[str], StderrFiles]:
    """torchrun's own parsing and LaunchConfig, for `python -m dflash_async run` on every rank,
    with the ranks' stderr in the log files (read back for the `error:` line).

    torchrun sets OMP_NUM_THREADS=1 for several ranks a node when it is unset, announcing it
    with a multi-line banner of asterisks; the same default is set here first (the ranks inherit
    this process's environment), as one `launch_omp_threads` event."""
    args = parse_launch_args(argv)
    ranks = determine_local_world_size(args.nproc_per_node)
    if "OMP_NUM_THREADS" not in os.environ and ranks > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
        if log is not None:
            log.info(
                "launch_omp_threads",
                omp_num_threads=1,
                ranks_per_node=ranks,
                reason="torchrun's default for several ranks a node; set OMP_NUM_THREADS to "
                "choose another",
            )
    _rendezvous_defaults(args)
    config, entrypoint, entry_args = config_from_args(args)
    specs = StderrFiles(
        log_dir=config.logs_specs.root_log_dir,
        redirects=_std(args.redirects, with_stderr=True),
        tee=_std(args.tee, with_stderr=False),
    )
    return replace(config, logs_specs=specs), entrypoint, entry_args, specs


def parse_launch_args(argv: Sequence[str]) -> argparse.Namespace:
    """torchrun's options before an optional `-- run`; anything else is a UsageError (exit 2)."""
    options, command = _split_command(list(argv))
    if command != RANK_COMMAND:
        raise UsageError(f"launch: the ranks run `run`, got {' '.join(command) or 'nothing'!r}")
    parser = get_args_parser()
    parser.prog, parser.usage = PROG, USAGE
    parser.description = __doc__.split("\n\n")[0]
    parser.error = _usage_error  # type: ignore[method-assign]  # one line, exit 2
    args = parser.parse_args([*options, "--module", "dflash_async", *RANK_COMMAND])
    if args.training_script != "dflash_async" or args.training_script_args != RANK_COMMAND:
        raise UsageError(f"launch takes torchrun's options only, got {args.training_script!r}")
    for name in ("no_python", "run_path", "logs_specs"):
        if getattr(args, name):
            raise UsageError(f"launch: --{name.replace('_', '-')} is not supported")
    args.redirects = _merge_redirects(args.redirects)
    return args


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, the ranks' command: `run` when there is no `--`)."""
    if "--" not in argv:
        return argv, RANK_COMMAND
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def _usage_error(message: str) -> NoReturn:
    raise UsageError(f"launch: {message} (see launch --help)")


def _merge_redirects(redirects: str) -> str:
    """stderr always to the files; a user's stdout redirect too (torchrun's Std values)."""
    return "3" if redirects in ("1", "3") else STDERR_ONLY


def _std(value: str, *, with_stderr: bool) -> Std:
    std = Std.from_str(value)
    if isinstance(std, dict):  # per-rank values ("0:1,1:2"): the whole-node value is simpler
        raise UsageError("launch: per-rank --redirects/--tee values are not supported")
    return std | Std.ERR if with_stderr else std


def _rendezvous_defaults(args: argparse.Namespace) -> None:
    """What torch.distributed.run.run() does to its arguments before config_from_args (inline
    there, not a function we could call): --standalone and a one-node static rendezvous become a
    c10d one on a free local port."""
    _, max_nodes = _max_nodes(args.nnodes)
    one_node_static = (
        args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
    )
    if args.standalone or (one_node_static and max_nodes == 1):
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _max_nodes(nnodes: str) -> tuple[int, int]:
    try:
        return parse_min_max_nnodes(nnodes)
    except (RuntimeError, ValueError) as error:
        raise UsageError(f"launch: --nnodes {nnodes!r}: {error}") from None


class StderrFiles(DefaultLogsSpecs):
    """torch's default log files, remembering where each local rank's stderr went."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.stderrs: dict[int, str] = {}

    def reify(self, envs: dict[int, dict[str, str]]) -> Any:
        destinations = super().reify(envs)
        self.stderrs = dict(destinations.stderrs)  # the latest attempt's files
        return destinations
