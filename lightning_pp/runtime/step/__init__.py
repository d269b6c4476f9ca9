"""One training or evaluation step: the step loop (executor), one action's forward/backward (stage), the loss and the
end-of-step decisions (loss), microbatches (microbatch), per-stage random streams (rng) and the gradient reductions (grads).
"""
