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

A memory size takes its unit, because "80" means 80 GiB to torch (torch.cuda.mem_get_info,
nvidia-smi's MiB) and 80 GB (10^9) to a data sheet; the two differ by 7 %, enough to turn a run
that fits into "DOES NOT FIT". memory_bytes() reads "80GiB", "80GB", "512MiB", "1.5TiB"; a bare
number is GiB, as torch reports:

    memory_bytes("80") == memory_bytes("80GiB") == 80 * 2**30;  memory_bytes("80GB") == 80e9
"""
from __future__ import annotations

import re
import sys
from typing import Callable, Dict, Tuple

EXIT_BAD_INPUT = 2


def positive_ints(args, flags: Dict[str, str]) -> None:
    """Refuse (ValueError) each of `flags` (argparse dest -> what it counts) that is set and < 1."""
    bad = [f"--{name.replace('_', '-')} must be a positive integer ({what}), got {getattr(args, name)}"
           for name, what in flags.items()
           if getattr(args, name, None) is not None and getattr(args, name) < 1]
    if bad:
        raise ValueError("; ".join(bad))


MEMORY_UNITS = {"": 2 ** 30, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
                "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def memory_bytes(text: str, flag: str = "--gpu-memory") -> float:
    """Bytes of a memory size: a number and an optional unit (GB = 10^9, GiB = 2^30; none: GiB)."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = found.group(2).lower() if found else None
    if unit not in MEMORY_UNITS:
        raise ValueError(f"{flag} must be a memory size such as 80GiB, 80GB or 80 (GiB), got {text!r}")
    value = float(found.group(1)) * MEMORY_UNITS[unit]
    if value <= 0:
        raise ValueError(f"{flag} must be more than 0 bytes, got {text!r}")
    return value


def within(args, rules: Dict[str, Tuple[Callable[[float], bool], str]]) -> None:
    """Refuse (ValueError) each set float flag that breaks its rule: dest -> (test, what it must be)."""
    bad = [f"--{name.replace('_', '-')} must be {must}, got {getattr(args, name):g}"
           for name, (test, must) in rules.items()
           if getattr(args, name, None) is not None and not test(getattr(args, name))]
    if bad:
        raise ValueError("; ".join(bad))


def fail(err: BaseException) -> int:
    """Print the error as the tool's one line on stderr; return the exit status (2)."""
    print(f"error: {err}", file=sys.stderr)
    return EXIT_BAD_INPUT
