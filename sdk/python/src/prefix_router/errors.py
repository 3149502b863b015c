"""Errors: every failed call raises a `PrefixRouterError` subclass named after its gRPC code
(`NotFoundError` for NOT_FOUND, ...), whose text starts with the code as gRPC spells it."""

import grpc


class PrefixRouterError(Exception):
    """A call the control plane refused or could not answer.

    `code` is the `grpc.StatusCode`, `code_name` its name (`"NOT_FOUND"`), `message` the
    server's message as sent (it names the field and the value).
    """

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode = None):
        if code is not None:
            self.code = code
        self.message = message
        super().__init__(f"{self.code_name}: {message}")

    @property
    def code_name(self) -> str:
        return self.code.name


def _class_name(code: grpc.StatusCode) -> str:
    return "".join(part.capitalize() for part in code.name.split("_")) + "Error"


#: One subclass per gRPC code: `InvalidArgumentError`, `NotFoundError`, `AlreadyExistsError`,
#: `FailedPreconditionError`, `UnauthenticatedError`, `PermissionDeniedError`,
#: `UnavailableError`, `DeadlineExceededError`, ...
ERRORS = {
    code: type(_class_name(code), (PrefixRouterError,), {"code": code, "__module__": __name__})
    for code in grpc.StatusCode
    if code is not grpc.StatusCode.OK
}
globals().update({cls.__name__: cls for cls in ERRORS.values()})


def from_rpc_error(e: grpc.RpcError) -> PrefixRouterError:
    """The exception for a failed call (its class named after the code)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    cls = ERRORS.get(code, PrefixRouterError)
    return cls(details or "", code)


__all__ = ["PrefixRouterError", "ERRORS", "from_rpc_error"] + [c.__name__ for c in ERRORS.values()]
