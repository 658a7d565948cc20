"""Hypothesis profiles for every test of the repository (the core's and the bundled plugins').

``ppokit`` (the default): each property test draws the same examples on every machine and
every run (``derandomize``: the seed is a hash of the test), so the README's test command
tests what CI tested; a failure prints the example and a ``@reproduce_failure`` blob.
``explore`` (``pytest --hypothesis-profile=explore``, with ``--hypothesis-seed=N`` to repeat a
run): fresh random examples each run, to look for inputs the fixed ones miss.
"""

from hypothesis import settings

settings.register_profile("ppokit", derandomize=True, print_blob=True, database=None)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("ppokit")
