"""One hierarchy for every error lucepy raises on purpose.

The CLI prints ``str(err)`` on one line and exits non-zero; the server maps the *type* to an
HTTP status.
Each message says what went wrong and what to do next.
"""

from __future__ import annotations


class LucepyError(Exception):
    """Base of every error lucepy raises for a user to read."""


# ggml binding
class GGMLError(LucepyError):
    """libggml could not be found, loaded or trusted, or a ggml call failed."""


class GGMLCommitMismatch(GGMLError):
    """The loaded libggml was built from another commit than the pin."""


# model files
class ModelFileError(LucepyError):
    """A GGUF file is missing, malformed or not what the model needs."""


class ModelFileNotFound(ModelFileError):
    pass


class BadMagic(ModelFileError):
    pass


class TruncatedFile(ModelFileError):
    pass


class UnsupportedArchitecture(ModelFileError):
    pass


class MissingMetadata(ModelFileError):
    pass


class MissingTensor(ModelFileError):
    pass


class TensorShapeMismatch(ModelFileError):
    pass


# configuration and input
class ConfigError(LucepyError):
    """A flag or option has a value lucepy cannot use."""


class DeviceError(ConfigError):
    """A device name is unknown, duplicated or not available in this build."""


class ContextOverflow(ConfigError):
    """A request needs more positions than the context holds."""


class PromptError(ConfigError):
    """A prompt is empty or cannot be tokenized."""


class CatalogError(ConfigError):
    """models.yaml cannot be read, or a model name does not resolve to a file."""


class UnknownModel(CatalogError):
    """A model name is neither a file nor a models.yaml entry."""


# serving
class ServerError(LucepyError):
    """The server cannot take or finish a request."""


class AuthError(ServerError):
    """A request's API key is missing or wrong."""


class ModelUnavailable(ServerError):
    """The model failed, or the server is shutting down."""


class ServerUnreachable(ServerError):
    """A lucepy server (``lucepy top``) cannot be reached or answered nonsense."""


# processes
class StaleVerify(LucepyError):
    """A verify step committed after another step ran: its rollback would undo the wrong one."""


class WorkerError(LucepyError):
    """A worker process could not start, or died while serving a shard."""


class BuildError(LucepyError):
    """Building a ggml backend failed."""
