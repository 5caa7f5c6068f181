"""The web dashboard: pages, their assets and the JSON endpoints that feed them."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from vramtune.service.dashboard import api, importance, pages

# Every dashboard request counts as activity: the importance evaluators are imported in a quiet
# moment, never beside a page being drawn.
router = APIRouter(lifespan=importance.lifespan, dependencies=[Depends(importance.track_activity)])
router.include_router(api.router)
router.include_router(pages.router)

__all__ = ["router"]
