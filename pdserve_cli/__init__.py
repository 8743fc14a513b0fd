"""The `pdserve` command line: `main` builds the parser from the `cmd_*.py` modules beside it,
one subcommand per module (top level, or under `pdserve bench`). Each module defines NAME, HELP,
GROUP (None or "bench"), `add_arguments(parser)` and `run(args) -> int`, and imports its heavy
dependencies inside `run` so `pdserve --help` stays fast.
"""
