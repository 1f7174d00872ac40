"""Errors that cross layers: what a client did wrong, and what the server could not do."""


class RequestError(ValueError):
    """A request the server will not run; `field` names the offending input for the client."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


class ServerBusy(RuntimeError):
    """Admission control refused a request (the server is full or shutting down); the client may
    retry later, or elsewhere."""


def utf8(text: str, field: str) -> bytes:
    """`text` in UTF-8; RequestError naming `field` for a string that has none (a lone surrogate,
    which JSON's \\ud800 escapes and Python's surrogateescape let through)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(
            field, f"not valid Unicode (a lone surrogate at character {error.start})"
        ) from None
