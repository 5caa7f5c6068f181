"""The web dashboard: pages, their assets and the JSON endpoints that feed them."""

from __future__ import annotations

from fastapi import APIRouter

from service.dashboard import api, importance, pages

router = APIRouter(lifespan=importance.lifespan)
router.include_router(api.router)
router.include_router(pages.router)

__all__ = ["router"]
