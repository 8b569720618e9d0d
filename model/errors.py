"""Named errors raised while finding, reading or loading a checkpoint."""


class ModelLoadError(Exception):
    """Base class: the checkpoint could not be turned into a model."""


class CheckpointNotFoundError(ModelLoadError, FileNotFoundError):
    """A file the checkpoint needs is missing."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint describes a network this package does not implement."""


class UnsupportedQuantizationError(ModelLoadError):
    """A tensor is stored in a quantization type this package cannot dequantize."""


class ShapeMismatchError(ModelLoadError):
    """A tensor's shape disagrees with the config; the message names the tensor."""

    def __init__(self, name: str, expected: tuple, got: tuple):
        self.tensor_name = name
        self.expected = tuple(expected)
        self.got = tuple(got)
        super().__init__(f"tensor {name!r} has shape {self.got}, expected {self.expected}")
