"""``/health`` and ``/v1/models``."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from kvjax.serving.api.service import Service, service

router = APIRouter()


@router.get("/health")
async def health(s: Service = Depends(service)):
    running = s.driver.running
    body = {
        "status": "ok" if running else "unavailable",
        "slots": s.driver.engine.slots,
        "active": s.driver.active,
        "waiting": s.driver.waiting,
    }
    if s.contexts is not None:
        body["contexts"] = s.contexts.store.usage()
    return JSONResponse(body, status_code=200 if running else 503)


def card(s: Service) -> dict:
    return {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "kvjax"}


@router.get("/v1/models")
async def models(s: Service = Depends(service)):
    return {"object": "list", "data": [card(s)]}


@router.get("/v1/models/{name:path}")
async def model(name: str, s: Service = Depends(service)):
    s.check_model(name)
    return card(s)
