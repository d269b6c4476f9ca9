"""One training or evaluation step: the step loop (executor), one action's forward/backward (stage), the loss and the
end-of-step decisions (loss), microbatches (microbatch) and per-stage random streams (rng). The gradient reductions
below it are in ``runtime/dp``.
"""
