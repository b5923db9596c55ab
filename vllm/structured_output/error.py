"""StructuredOutputError: a structured-output spec that cannot be compiled."""


class StructuredOutputError(ValueError):
    """`.field` names the offending spec ("json", "regex", "choice", "grammar" or
    "json_object"), so that the server's 400 can point at the request field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
