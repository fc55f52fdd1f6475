"""Errors a user can act on. The CLI prints their message, without a traceback, and exits 2."""


class QieError(Exception):
    """Base class: the message names the file or key at fault and says what to do."""


class ConfigError(QieError):
    """A config key or value that cannot work."""


class DataError(QieError):
    """A data set input (image, caption, manifest row) that cannot be read."""


class CacheMissError(QieError):
    """Cached mode needs an entry the cache does not hold."""


class ModelLoadError(QieError):
    """A model part, LoRA or checkpoint that cannot be loaded."""


class StorageError(QieError):
    """A folder or file qie must read or write is not usable: missing, a file, not writable, disk full."""


class CacheDirMissing(StorageError):
    """The cache folder a reader needs does not exist (to training: every entry is missing)."""
