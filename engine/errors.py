"""Errors the engine reports to people: every message is one line that names the file and the problem."""


class MoedeskError(Exception):
    """Base class: the message is shown to the user as it is, on one line."""


class CheckpointError(MoedeskError):
    """A model file or folder that cannot be used (missing, corrupt, unsupported)."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnsupportedModelError(CheckpointError):
    """A well-formed checkpoint of an architecture or variant moedesk does not run."""


class EngineUnavailable(MoedeskError):
    """No request can run now, whichever it is (a remote server that cannot be reached): a batch run stops at once
    with this line, rather than blaming each line in turn, and resumes on the next run."""
