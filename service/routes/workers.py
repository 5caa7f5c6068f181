"""Worker protocol routes (workers): filled by the fleet issue."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
