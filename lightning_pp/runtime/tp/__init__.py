"""Tensor parallelism inside pipeline stages: which DTensor parameters are the tensor-parallel
ones the pipeline drives, and what the rest of the runtime needs to know about them."""
