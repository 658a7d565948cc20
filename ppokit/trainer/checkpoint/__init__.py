"""Checkpoints: ``OUT/checkpoint/`` with the actor and critic weights, the optimizer and
scheduler states, every process's RNG states (python, numpy, torch, CUDA) and the prompt
source's position, the round counter, the adaptive KL state and the resolved spec.

Reading a checkpoint never runs code: nothing is unpickled. Tensors are stored as
safetensors, everything else as JSON::

    checkpoint/
      manifest.json        {"format": 4, "files": {path: {"sha256": ..., "bytes": ...}}}
      state.json           format, round, KL coefficient, critic kind, processes, the
                           LoRA base weights' sums
      spec.yaml            the resolved spec of the run
      actor/               actor weights: shard-0000K-model-00001-of-00001.safetensors, one
                           file per process holding its shards (one file: the whole state);
                           with LoRA the trained parameters alone (the adapters): the frozen
                           base weights are the spec's model's, checked against two sums
                           recorded in state.json
      critic/              critic weights, the same way (the value head only for a shared
                           critic)
      optim/               the optimizer states' tensors, the same way
      optim.json           the optimizer states keyed by parameter name (torch.distributed.
                           checkpoint's form) and the scheduler states, tensors as
                           {"$tensor": name} (a name in optim/)
      rng/process-0000K.json         process K's python and numpy RNG states and the
      rng/process-0000K.safetensors  prompt source's state; its torch and CUDA RNG states
      ahead/process-0000K.json       asynchronous rollouts: process K's batches generated
      ahead/process-0000K.safetensors  for the rounds after this one (:mod:`.ahead`)

The weights and optimizer states are written and read by ``torch.distributed.checkpoint``
(DCP) through its Hugging Face storage: every process writes its own shards (nothing is
gathered on one process) and reads back the parts its shards need, so a checkpoint resumes
on any number of processes, including one without a launcher, and the same DCP reader
gives ``ppokit export`` the whole weights. The files are plain safetensors whose header
carries DCP's shard offsets as JSON; a single-process run's ``actor/`` file is an ordinary
state dict.

The manifest is written last and holds a SHA-256 of every other file; a checkpoint is read
only once every checksum verifies and no file in its folders is unlisted. Writing is
atomic: a temporary directory ``.checkpoint.tmp`` is filled and synced, the previous
checkpoint is renamed to ``.checkpoint.old``, the temporary one to ``checkpoint``, and the
old one is removed. A crash between the two renames leaves no ``checkpoint``; resuming then
reads the complete copy (the newer ``.checkpoint.tmp`` when its manifest verifies, else
``.checkpoint.old``) and moves it back into place.

A checkpoint of an older format is not read: one line says so.

The package's modules, one job each: :mod:`.layout` (format, names, state.json's ranges),
:mod:`.states` (RNG, state trees, weights and optimizer states through DCP), :mod:`.ahead`
(the batches generated ahead), :mod:`.write` and :mod:`.read`.
"""

from __future__ import annotations

from ppokit.runfolder import CHECKPOINT, has_checkpoint
from ppokit.trainer.checkpoint.layout import FORMAT, MANIFEST
from ppokit.trainer.checkpoint.read import check_critic, load_checkpoint, read_state
from ppokit.trainer.checkpoint.states import (
    capture_rng,
    load_weights,
    restore_rng,
)
from ppokit.trainer.checkpoint.write import (
    NonFiniteCheckpointError,
    check_finite,
    checkpoint_round,
    save_checkpoint,
)

__all__ = [
    "CHECKPOINT",
    "FORMAT",
    "MANIFEST",
    "NonFiniteCheckpointError",
    "capture_rng",
    "check_critic",
    "check_finite",
    "checkpoint_round",
    "has_checkpoint",
    "load_checkpoint",
    "load_weights",
    "read_state",
    "restore_rng",
    "save_checkpoint",
]
