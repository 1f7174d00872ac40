"""Errors that cross layers: what a client did wrong, and what the server could not do."""


class RequestError(ValueError):
    """A request the server will not run; `field` names the offending input for the client."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


class ServerBusy(RuntimeError):
    """Admission control refused a request (the server is full or shutting down); the client may
    retry later, or elsewhere."""
