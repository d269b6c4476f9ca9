"""lightning_pp: pipeline and expert parallelism for PyTorch Lightning and Fabric."""
