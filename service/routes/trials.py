"""Worker protocol routes (trials): filled by the fleet issue."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
