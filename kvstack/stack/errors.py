"""Exceptions raised by kvstack. Every message names the field, the value and what is allowed."""


class KVStackError(Exception):
    """Base class of kvstack's own errors."""


class SpecError(KVStackError, ValueError):
    """A stack spec (preset, YAML, dict) is invalid or does not fit the model it is applied to."""


class UnsupportedModelError(KVStackError, ValueError):
    """The model's architecture is not one kvstack knows how to compose a cache for."""


class CacheUsageError(KVStackError, RuntimeError):
    """The cache was used in a way that would silently give wrong results (wrong attention, wrong mask)."""


def did_you_mean(name: str, choices) -> str:
    """' (did you mean 'x'?)' for a misspelt name, else ''."""
    import difflib

    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


#: pydantic error type of :func:`field_errors` (``describe_errors`` prints one line per field)
FIELD_ERRORS = "kvstack_fields"


def field_errors(lines: list[tuple[str, str]]):
    """One pydantic error carrying (field path, message) lines: for a model validator that knows which nested
    fields are wrong (a model-level error would otherwise point at the whole model and print all of its input)."""
    from pydantic_core import PydanticCustomError

    message = "; ".join(f"{path}: {text}" for path, text in lines)
    return PydanticCustomError(FIELD_ERRORS, "{message}", {"message": message, "lines": lines})
