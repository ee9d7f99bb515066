"""Errors caused by the user's input. The CLI prints these as one clear line instead of a traceback."""


class DepthscaleError(Exception):
    """Base of every error that names bad user input (config, data, checkpoint, world size)."""


class ConfigError(DepthscaleError, ValueError):
    """A config key or value is wrong; the message names the key and what is allowed."""


class DataError(DepthscaleError, ValueError):
    """A corpus, tokenizer or data file is missing, malformed or too small."""


class CheckpointError(DepthscaleError, RuntimeError):
    """A checkpoint is missing, incomplete or does not match the model being trained."""


class TrainingError(DepthscaleError, RuntimeError):
    """Training cannot go on (a NaN/Inf loss); the message says why and what was kept."""


class PeersFailed(TrainingError):
    """A collective or message timed out or lost its peer: a consequence of another rank's
    failure, not a cause (reported after the rank that failed first)."""
