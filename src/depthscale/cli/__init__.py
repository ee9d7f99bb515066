"""depthscale command line: `main` is the `depthscale` console script (and `python -m
depthscale.cli`). It parses (parser.py), runs one command's module (train, plan, generate, trace,
convert, diagnose) and turns what fails into one line and an exit code: bad input, a machine that
refuses a write, a lost peer, or, in a worker, a bug with its traceback, reported once per group.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback

from depthscale.cli import convert, diagnose, evaluate, generate, plan, tokenize, trace, train
from depthscale.cli.parser import build_parser
from depthscale.errors import ConfigError, DepthscaleError, PeersFailed
from depthscale.parallel.launcher import (
    BUG,
    INPUT,
    PEER_LOST,
    is_worker,
    peer_lost,
    record_worker_error,
)

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        return _run(parser, args, rest)
    except PeersFailed as err:
        return _fail(f"depthscale: error: {err}", PEER_LOST, 1)
    except DepthscaleError as err:
        kind = "config error" if isinstance(err, ConfigError) else "error"
        return _fail(f"depthscale: {kind}: {err}", INPUT, 2)
    except FileNotFoundError as err:
        return _fail(f"depthscale: error: {err}", INPUT, 2)
    except OSError as err:
        if err.errno not in _ENVIRONMENT_ERRNOS:
            raise
        return _fail(f"depthscale: error: {_os_error(err)}", INPUT, 2)
    except KeyboardInterrupt:
        return _fail("depthscale: interrupted", INPUT, 130)
    except Exception as err:
        if not is_worker():
            raise  # a bug: the traceback is the report
        if peer_lost(err):
            return _fail(f"depthscale: rank {_rank()} lost a peer process ({err})", PEER_LOST, 1)
        return _fail(
            f"depthscale: rank {_rank()} failed:\n{traceback.format_exc().rstrip()}", BUG, 1
        )


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, rest: list[str]) -> int:
    if args.command == "train":
        if args.nproc is not None:
            rest = [*rest, "--parallel.nproc", str(args.nproc)]
        if args.faults is not None:
            rest = [*rest, "--resilience.faults", args.faults]
        return train.run(args, rest)
    if args.command == "plan":
        return plan.run(args, rest)
    if args.command == "lm-eval":
        return evaluate.lm_eval(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "generate":
        return generate.run(args)
    if args.command == "trace":
        if args.what not in ("schedule",) and not args.run:
            parser.error(f"trace {args.what} needs --run DIR")
        return trace.run(args)
    if args.command == "diagnose":
        return diagnose.run(args)
    if args.command == "eval":
        return evaluate.run(args)
    if args.command == "tokenize":
        return tokenize.run(args)
    if args.direction == "hf-to-ds" and not args.hf:
        parser.error("convert hf-to-ds needs --hf DIR")
    if args.direction == "ds-to-hf" and not args.run:
        parser.error("convert ds-to-hf needs --run DIR")
    return convert.run(args)


_ENVIRONMENT_ERRNOS = {
    errno.EACCES,
    errno.EPERM,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EFBIG,
    errno.EROFS,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EEXIST,
    errno.ENAMETOOLONG,
}
"""Errors of the machine, not of depthscale: a path that cannot be made or written, a full disk.
Their report is one line naming the file, as for any other bad input."""


def _os_error(err: OSError) -> str:
    where = f"{err.filename}: " if err.filename else ""
    no_room = err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    full = " (a full disk, a quota or a file-size limit)" if no_room else ""
    return f"{where}{err.strerror} [{errno.errorcode.get(err.errno, err.errno)}]{full}"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _fail(message: str, kind: str, code: int) -> int:
    """Report an error once: a worker hands it to the launcher (which prints the root cause once
    for the whole group); a single process, or a worker under plain torchrun, prints it."""
    if not (is_worker() and record_worker_error(_rank(), kind, message)):
        print(message, file=sys.stderr, flush=True)
    return code
