"""The run library of the training scripts: what every script does the same way and nobody
edits to change an algorithm. Each module is read on its own (docs/DESIGN.md):

- flags: the run flags every script's Args inherits, ranges declared in annotations, presets,
  the command line (one line and exit code 2 for a user's mistake);
- runs: a run's life, from its flags to its exit code (`Run`);
- checkpoints: atomic writes, reading, restoring and resuming checkpoints; loading a script;
- logs: TensorBoard, metrics.jsonl and wandb; the progress line;
- tasks: envpool environments, their spaces, families and presets, game scores;
- normalize: the observation and reward normaliser;
- threads: queue calls with a stop event, a run's threads and their errors;
- devices: processes, the mesh, placement, lockstep collectives;
- evaluation: full games with a script's policy, a video.

The scripts at the repository root import it; it never imports them.
"""
