"""SmolLM2-135M-Instruct's conversion from its GGUF file (the first load of
``model.actor: smollm2-135m-instruct``, ``ppokit.trainer.models.load_actor`` with the cache
off): transformers parsing the file for each of the tokenizer, the config and the weights,
against the file parsed once (``ppokit.trainer.converted.one_gguf_parse``), alternating in
one process. Printed: the CPU and wall seconds of each load, their medians and the ratio.

    python benchmarks/gguf_load.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
import warnings

os.environ["PPOKIT_CACHE"] = "off"  # every load converts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import gguf

    from ppokit.trainer import converted
    from ppokit.trainer.models import SMOLLM2, load_actor

    parses = [0]
    reader = gguf.GGUFReader.__init__

    def counted(self: gguf.GGUFReader, *a: object, **k: object) -> None:
        parses[0] += 1
        reader(self, *a, **k)  # type: ignore[arg-type]

    gguf.GGUFReader.__init__ = counted  # type: ignore[method-assign]
    load_actor(SMOLLM2, {}, 0)  # warm: imports, the file in the page cache
    ways = {"each": contextlib.nullcontext, "once": converted.one_gguf_parse}  # each: as is
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, way in ways.items():
            converted.one_gguf_parse = way  # type: ignore[assignment]
            parses[0] = 0
            cpu, wall = time.process_time(), time.perf_counter()
            load_actor(SMOLLM2, {}, 0)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            times[name].append((cpu, wall))
            print(f"{name}: {parses[0]} parse(s), {cpu:.1f} s CPU, {wall:.1f} s wall", flush=True)
    each = statistics.median(c for c, _ in times["each"])
    once = statistics.median(c for c, _ in times["once"])
    print(f"median CPU: each {each:.1f} s, once {once:.1f} s, ratio {each / once:.2f}")


if __name__ == "__main__":
    main()
