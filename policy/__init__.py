"""L4 authorization: the policy model and its evaluation, as pure functions.

No sockets, no xDS: `authorize(policies, connection)` takes values and returns a `Decision`.
This package imports no other package of the project.
"""

from policy.model import (
    Action,
    Authorization,
    Connection,
    Match,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
)
from policy.rbac import Allow, Decision, Deny, authorize

__all__ = [
    "Action",
    "Allow",
    "Authorization",
    "Connection",
    "Decision",
    "Deny",
    "Match",
    "Scope",
    "ServiceAccountMatch",
    "StringMatch",
    "StringMatchKind",
    "authorize",
]
