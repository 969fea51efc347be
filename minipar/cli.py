"""What minipar's command-line tools share about bad input: one line on stderr, exit 2.

`python -m minipar.mesh` and `python -m minipar.plan` refuse a bad flag the way train.py refuses
a bad config ("[rank R] error: ..." there): ONE line naming the flag, the value and what it must
be, exit status 2, never a traceback. A size flag is a count of something (GPUs, ranks, stages,
rows), so 0 and negatives are refused by name before anything uses them; without this, --tp 0
reached ParallelismConfig as a traceback and --world 0 read as "not given" (0 is falsy):

    $ python -m minipar.plan --model configs/models/llama-3.1-8b.json --world -4
    error: --world must be a positive integer (the number of GPUs), got -4

positive_ints() checks every flag at once and names all the wrong ones in one error; fail()
prints the one line and gives the exit status for main() to return.
"""
from __future__ import annotations

import sys
from typing import Dict

EXIT_BAD_INPUT = 2


def positive_ints(args, flags: Dict[str, str]) -> None:
    """Refuse (ValueError) each of `flags` (argparse dest -> what it counts) that is set and < 1."""
    bad = [f"--{name.replace('_', '-')} must be a positive integer ({what}), got {getattr(args, name)}"
           for name, what in flags.items()
           if getattr(args, name, None) is not None and getattr(args, name) < 1]
    if bad:
        raise ValueError("; ".join(bad))


def fail(err: BaseException) -> int:
    """Print the error as the tool's one line on stderr; return the exit status (2)."""
    print(f"error: {err}", file=sys.stderr)
    return EXIT_BAD_INPUT
