"""What a training script does with signals in its first moments, before it imports torch (seconds).

Imports nothing but the standard library's os and signal, so that the scripts can import it first:

    import early_signals
    EARLY_STOPS = early_signals.catch_stops()           # a scheduler's SIGTERM/SIGUSR1, noted for later
    SIGINT_AT_START = early_signals.quiet_ctrl_c()      # a Ctrl-C: one line, not the import machinery's traceback
    import torch ...
    signal.signal(signal.SIGINT, SIGINT_AT_START)       # after the imports

ddp_runtime.FirstSignal takes the noted stops over once the script has its own handlers.
"""

import os
import signal

STOPS = (signal.SIGTERM, signal.SIGUSR1)  # what schedulers send before they kill (SLURM's --signal, preemption)


def catch_stops() -> list:
    """From now on a stop signal is noted in the returned list instead of killing the process: one that
    arrives while torch imports stops the run at its first step with a save and the PREEMPTED marker (a
    SLURM job is then requeued) instead of killing a rank that its peers would wait for."""
    received: list = []
    for sig in STOPS:
        signal.signal(sig, lambda signum, frame: received.append(signum))
    return received


def quiet_ctrl_c(say: bool = True):
    """A Ctrl-C from now on is death by SIGINT, as Python's own exit on Ctrl-C, with one line (`say`: this
    process's parent does not say it for it) in place of the import machinery's traceback. Returns the SIGINT
    handler to put back after the imports; a Ctrl-C the shell told the script to ignore stays ignored."""
    at_start = signal.getsignal(signal.SIGINT)
    if at_start is signal.default_int_handler:
        signal.signal(signal.SIGINT, lambda signum, frame: _die_of_ctrl_c(signum, say))
    return at_start


def _die_of_ctrl_c(signum: int, say: bool) -> None:
    signal.signal(signum, signal.SIG_DFL)
    try:  # a closed stderr (`| tee`, ended by the same Ctrl-C) must not keep the process alive
        if say:
            os.write(2, b"stopped by Ctrl-C while starting: nothing ran\n")
    finally:
        os.kill(os.getpid(), signum)
