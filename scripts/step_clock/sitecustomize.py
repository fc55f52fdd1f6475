"""Per-step clock for `scripts/bench_peers.py`: on the path of a trainer it times (qie or a peer), each
optimizer step appends the wall-clock time (epoch seconds) it ended to the file `QIE_STEP_CLOCK` names.

The same mark for every trainer: torch's global optimizer step hook, so the interval between two marks is one
whole loop iteration (batch, forward, backward, update, logging), whatever each trainer's own timers measure.
Without `QIE_STEP_CLOCK` in the environment it does nothing and imports nothing.
"""

import os

_PATH = os.environ.get("QIE_STEP_CLOCK")
if _PATH:
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    _PID = os.getpid()
    _OUT = open(_PATH, "a", buffering=1)  # noqa: SIM115 - open for the process's lifetime, one line per step

    def _mark(optimizer, args, kwargs):
        if os.getpid() == _PID:  # not in loader workers forked after start-up
            _OUT.write(f"{time.time():.6f}\n")

    HANDLE = register_optimizer_step_post_hook(_mark)  # .remove() takes the clock off
