"""Exceptions raised by kvstack. Every message names the field, the value and what is allowed."""


class KVStackError(Exception):
    """Base class of kvstack's own errors."""


class SpecError(KVStackError, ValueError):
    """A stack spec (preset, YAML, dict) is invalid or does not fit the model it is applied to."""


class UnsupportedModelError(KVStackError, ValueError):
    """The model's architecture is not one kvstack knows how to compose a cache for."""


class CacheUsageError(KVStackError, RuntimeError):
    """The cache was used in a way that would silently give wrong results (wrong attention, wrong mask)."""
