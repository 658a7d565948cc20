"""``python -m ppokit`` (what ``torchrun -m ppokit train SPEC`` starts on each process)."""

import sys

from ppokit.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
