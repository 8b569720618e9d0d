"""The error a request's bad fields raise, wherever they are found (the request's own checks, the
constraint compiler): each edge maps it to its own error (INVALID_ARGUMENT, HTTP 400)."""

from __future__ import annotations


class RequestValidationError(ValueError):
    """One or more fields of a request are invalid; `violations` lists (field, description)."""

    def __init__(self, violations: list[tuple[str, str]]):
        self.violations = list(violations)
        super().__init__("; ".join(f"{f}: {d}" for f, d in self.violations))


__all__ = ["RequestValidationError"]
