"""The data-parallel machinery below the step loop: the gradient reductions over data- and
expert-parallel replicas (grads), sharding stages with FSDP2 (sharding) and reducing the sharded
gradients (sharded_grads), and the global gradient norm (norm).
"""
