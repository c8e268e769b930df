"""Which deployments a caller may see: a runtime token only its own, and it learns nothing of
the others (another deployment and a missing one are both 403). Read through the per-process
deployment cache (`DeploymentCache`, `app.state.deployment_cache`)."""

from __future__ import annotations

from typing import Annotated

from anyio import to_thread
from fastapi import Depends

from controlplane.auth.deps import require
from controlplane.auth.service import Principal
from controlplane.errors import NotFound


def visible_deployment(state, principal: Principal, name: str, versions=()):
    """The deployment `name` as the process caches it (`CachedDeployment`), if `principal` may
    see it (blocking: may read the store). A runtime token is refused alike (403) for
    another deployment and for one that does not exist, so it cannot learn which exist;
    others get NotFound for a missing one."""
    try:
        target = state.deployment_cache.get(name, versions)
    except NotFound:
        if principal.scope == "runtime":
            principal.require_deployment(None)  # no deployment: not the token's own
        raise
    principal.require_deployment(target.id)
    return target


async def require_visible(state, principal: Principal, name: str) -> None:
    """`visible_deployment` for the event loop: from the cache when it holds `name`, else on a
    worker thread."""
    target = state.deployment_cache.peek(name, ())
    if target is None:
        await to_thread.run_sync(visible_deployment, state, principal, name)
    else:
        principal.require_deployment(target.id)


# Any token; a runtime token only on its own deployment (checked before the route runs).
RuntimePrincipal = Annotated[Principal, Depends(require("runtime", reach=require_visible))]
