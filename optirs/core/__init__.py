"""The bottom layer: errors, array descriptions, layout, hyperparameters, per-step scalars,
the float64 reference and the one CUDA-simulator check. Imports nothing else of optirs."""
