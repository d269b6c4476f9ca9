"""Fine-grained schedule plans (Megatron's ``build_schedule_plan``): the node and plan classes (plan), the runtime's chunk
plan (nodes), the zero-bubble split of a backward into input and weight gradients (weight_grad). What a layer may ask
about the microbatch being run is ``runtime/context.py``, below.
"""
