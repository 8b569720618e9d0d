"""Per-machine choices measured at load and cached: the precision mode and kernels, the quality
probe they must pass, and whether the decoder layers are compiled."""
