"""Asynchronous RL: generation in its own process, overlapped with training (docs/async.md).

    buffer.py     the bookkeeping, pure: groups tagged with their behaviour version, the bounded
                  version pool, the staleness filter (drop + count) and the version sampling rule
    worker.py     the generator process: builds the engine, takes weights and requests, answers
                  each request with the rows, their log-probs and the version that wrote them
    process.py    the trainer's handle on that process: start, restart (requests redone), stop,
                  and its death when the trainer dies
    pending.py    the requests in flight at a checkpoint, written beside it and asked again on resume
    weightfile.py a weight version as one shared-memory file (header + flat buckets): the trainer
                  packs into it, only its path goes through the pipe, the generator maps it
    export.py     each version's file from a trainer of any layout (TP x PP x DP): the full HF layout
                  gathered into rank 0, the one writer; every rank makes the same calls
    mode.py       the trainer's seams: AsyncCollector (the step's rows from the buffer; one generator
                  per model replica, on its leader, the rows broadcast to the replica) and
                  AsyncBehaviour (decoupled PPO's correction, the push after each update, metrics)

Synchronous training is the special case max_staleness = 0 (the ordinary loop); this mode needs
max_staleness >= 1.
"""

from pfppo_mega.trainer.asynchronous.mode import AsyncResumeError, build_async, check_resume, save_pending  # noqa: F401
