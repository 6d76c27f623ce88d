"""User-facing errors: one clear line, a non-zero exit, never a traceback."""


class TsspecError(Exception):
    """An error the CLI prints as one line (``error: ...``) and exits non-zero on."""

    exit_code = 1


class BadInput(TsspecError):
    """Bad user input: a flag value, a file, a prompt."""

    exit_code = 2


class ModelFileError(TsspecError):
    """A GGUF file that is missing, truncated, corrupt, or of an unknown architecture."""

    exit_code = 3
