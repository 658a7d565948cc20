"""``python -m ppokit`` (what ``torchrun -m ppokit train SPEC`` starts on each process)."""

from ppokit.cli import main

if __name__ == "__main__":
    main()
