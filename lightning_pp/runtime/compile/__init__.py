"""``compile=``: compiling the pipeline layers so the zero-bubble split still works (layers), and
counting compilations, recompilations and graph breaks per step (watch).
"""
