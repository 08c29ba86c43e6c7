"""`stepserve` command line: dispatches to `serve`, `generate`, `bench`, `simulate` and `view`."""

from __future__ import annotations

import sys

from service.cli.version import package_version

USAGE = """usage: stepserve {serve,generate,bench,simulate,view} [options] | --version

  serve      start the OpenAI-compatible server (default model: SmolLM2-135M-Instruct)
  generate   offline batch inference: a JSON Lines file of OpenAI requests to responses
  bench      Poisson load generator against an OpenAI-compatible server
  simulate   virtual-clock simulator driving the real scheduler
  view       play a simulator timeline (simulate --timeline-json) in the dashboard

Run `stepserve COMMAND --help` for the options of each command."""


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; its exit status."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "--version":
        print(package_version())
        return 0
    command, rest = args[0], args[1:]
    if command == "serve":
        from service.cli.serve import main as serve_main

        return serve_main(rest)
    if command == "generate":
        from service.cli.generate import main as generate_main

        return generate_main(rest)
    if command == "bench":
        from loadgen.bench import main as bench_main

        return bench_main(rest)
    if command == "simulate":
        from loadgen.sim.cli import main as simulate_main

        return simulate_main(rest)
    if command == "view":
        from service.cli.view import main as view_main

        return view_main(rest)
    print(f"stepserve: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
