"""Exceptions of spar_comm. Each is raised on every rank alike, never on one alone."""


class SparCommError(Exception):
    """Base of every error spar_comm raises on purpose."""


class ConfigError(SparCommError, ValueError):
    """A topology or allreducer was asked for with bad or disagreeing settings."""


class GradientError(SparCommError, ValueError):
    """A gradient handed to ``allreduce`` was refused; no state was changed."""


class WriteError(SparCommError, OSError):
    """A checkpoint or trace could not be written (a full disk); it names the
    file, and a checkpoint written before stays as it was."""


class NonFiniteGradientError(GradientError):
    """A gradient held NaN or Inf on some rank; no state was changed, so the
    caller may skip the step (every rank sees this error alike)."""
