"""ferry's errors: one class per ferry::StatusCode, all under ferry.Error.

Each also derives from the built-in exception a Python caller would catch for it (a missed
deadline is a TimeoutError, a lost peer a ConnectionError, a bad argument a ValueError).
"""


class Error(RuntimeError):
    """A ferry call failed; `code` names the ferry::StatusCode."""

    code = "Unknown"


class Cancelled(Error):
    code = "Cancelled"


class InvalidArgument(Error, ValueError):
    code = "InvalidArgument"


class OutOfRange(Error, IndexError):
    code = "OutOfRange"


class NotFound(Error, LookupError):
    code = "NotFound"


class AlreadyExists(Error):
    code = "AlreadyExists"


class DeadlineExceeded(Error, TimeoutError):
    code = "DeadlineExceeded"


class ResourceExhausted(Error):
    code = "ResourceExhausted"


class Unavailable(Error, ConnectionError):
    code = "Unavailable"


class Unimplemented(Error, NotImplementedError):
    code = "Unimplemented"


class FailedPrecondition(Error):
    code = "FailedPrecondition"


class Internal(Error):
    code = "Internal"


class DataLoss(Error):
    code = "DataLoss"
