"""The pieces of a run's life around its rounds, which :func:`ppokit.trainer.loop.train`
puts in order (docs/design.md, "Order of a round"):

- :mod:`.opening`: where the run runs: the processes, the output folder and its lock, the
  display; the built run (:func:`ppokit.trainer.run.build`), closed at the end;
- :mod:`.resume`: where the rounds start: round 0, or a checkpoint's round with the prompt
  source, the records and the producer as it left them;
- :mod:`.records`: each round's record (metrics, evaluation, health signs) written to
  metrics.jsonl, the samples and the trackers;
- :mod:`.ending`: a stop (Ctrl-C, SIGTERM, an error: :mod:`ppokit.trainer.stopping` keeps
  the last finished round) or the end of a finished run (curves, summary);
- :mod:`.smoke`: the smoke run's spec and folder.

The round (:mod:`ppokit.trainer.round`) and the producers know nothing of these
(tests/test_layers.py).
"""
