"""Cutting a model into this rank's chunks: the partition, the layout of layers per virtual stage, and meta-device
materialisation of what a rank keeps.
"""
