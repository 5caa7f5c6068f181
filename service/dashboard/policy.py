"""What the auth guard requires of each dashboard route: pages and assets are public (they
carry no data), every JSON endpoint needs the ``read`` scope.

``service.auth`` merges this into its policy table, so a new dashboard route cannot be missed:

    for method, path, relation in dashboard_policy.endpoints():
        POLICY[(method, path)] = PUBLIC if relation is None else needs("read", studies=relation)
"""

from __future__ import annotations

from typing import Literal

from fastapi.routing import APIRoute

from service.dashboard import api, pages

# "path": the route names its study by {name:path}; "many": it shows several studies (the list, the
# fleet's current trials), so a token limited to some studies is refused.
StudyRelation = Literal["path", "many"]


def endpoints() -> list[tuple[str, str, StudyRelation | None]]:
    """(method, path template, study relation) of every dashboard route; None means public."""
    found: list[tuple[str, str, StudyRelation | None]] = []
    for route in pages.router.routes:
        assert isinstance(route, APIRoute)
        found += [(method, route.path, None) for method in sorted(route.methods or ())]
    for route in api.router.routes:
        assert isinstance(route, APIRoute)
        relation: StudyRelation = "path" if "{name:path}" in route.path else "many"
        found += [(method, route.path, relation) for method in sorted(route.methods or ())]
    return found
