"""`embedserve` command line: serve, plan, bench, index (vLLM-style flags, EMBEDSERVE_* fallbacks).

One module per group of subcommands: `serve` (serve, plan), `index`, `reindex`; `bench` owns its flags."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the flag and what is wrong; `--help` lists the flags)
    instead of the usage block, so a bad flag reads like a bad setting."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import index as index_cmds, reindex as reindex_cmds, serve as serve_cmds

    p = Parser(prog="embedserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    serve_cmds.register(sub)
    # dispatched in main() before parsing; listed here for the help text
    sub.add_parser("bench", help="`bench embed|generate`: load generator for any OpenAI-compatible server "
                   "(`embedserve bench embed --help`)", add_help=False)
    index_cmds.register(sub)
    reindex_cmds.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        # the benchmarks own all of their flags, --help included
        if argv[1:2] in (["embed"], ["generate"]):
            from ..bench.load import main as load_main
            return load_main(argv[1:])
        usage = ("usage: embedserve bench {embed,generate} ...\n\n"
                 "  embed      load generator for POST /v1/embeddings on any OpenAI-compatible server\n"
                 "  generate   load generator for /v1/completions and /v1/chat/completions (streaming)\n\n"
                 "`embedserve bench SUBCOMMAND --help` lists each one's flags. The side-by-side run against\n"
                 "infinity-emb, vLLM and HF is a study beside the product: `make bench`\n"
                 "(python -m embedserve.studies.compare; BENCHMARKS.md lists the others).\n")
        if argv[1:2] in (["-h"], ["--help"]):
            print(usage, end="")
            return 0
        print("embedserve bench: choose `embed` or `generate` (a load generator)\n\n"
              + usage, file=sys.stderr, end="")
        return 2
    try:
        try:
            args = build_parser().parse_args(argv)  # EMBEDSERVE_* fallbacks are read (and checked) here
        except SystemExit as exc:                   # --help, or a bad flag whose one line is printed
            return exc.code if isinstance(exc.code, int) else 2
        return args.func(args)
    except (ConfigError, OSError) as exc:          # a setting that cannot work, a path that is not there
        print(f"embedserve: error: {exc}", file=sys.stderr)
        return 2

