"""The API's OpenAPI document, completed for client generators: every error answer documented
with the `Error` body, the bearer scheme and the answers each operation can give."""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import FastAPI

from controlplane.auth.deps import get_principal
from controlplane.edge.body import takes_json_body
from controlplane.errors import ERROR_SCHEMA, NOT_JSON, VALIDATION_ERROR, error_answer
from controlplane.guards.policy import policy_for


def documenting_our_validation_errors(build: Callable[[], dict],
                                       app: FastAPI) -> Callable[[], dict]:
    """FastAPI's OpenAPI document, completed for client generators: the `Error` body
    (`ERROR_SCHEMA`, which `error_answer` refers to) on every error answer, the 422 that
    `handlers.validation_error` sends wherever FastAPI documented its own list-of-errors body
    (which this app never answers), the bearer scheme on every operation that needs a token
    with its 401 and 403, 404 where the path or a `deployment` field names something, 413
    where a body is read, 415 on JSON bodies, 429 on rate-limited operations, 503 (the store
    away), a description on every operation and the route's name as its operationId; the
    bodies a route spells out itself are moved into components (`_hoist_body_schemas`)."""
    def openapi() -> dict:
        schema = build()  # FastAPI builds it once and caches it
        components = schema.setdefault("components", {})
        if "Error" not in components.setdefault("schemas", {}):  # not yet rewritten
            components["schemas"]["Error"] = ERROR_SCHEMA
            components["schemas"].pop("HTTPValidationError", None)
            components["schemas"].pop("ValidationError", None)
            components["securitySchemes"] = {BEARER: {
                "type": "http", "scheme": "bearer",
                "description": "an API token (`exitplane tokens create`; the first admin "
                               "token: `exitplane bootstrap token`): runtime tokens for "
                               "pulls, heartbeats and telemetry, operator or admin tokens for "
                               "the rest"}}
            for route, method, operation in _operations(app, schema):
                _complete(route, method, operation)
            _hoist_body_schemas(schema)
        return schema

    return openapi


def _hoist_body_schemas(schema: dict) -> None:
    """Move the request-body schemas a route spells out itself (telemetry's, one per content
    type) and the `$defs` inside them into components, referred to by `$ref` as FastAPI refers
    to its own: client generators resolve no `#/$defs/...` inside an operation."""
    components = schema["components"]["schemas"]

    def keep(name: str, definition: dict) -> dict:
        if components.setdefault(name, definition) != definition:
            raise ValueError(f"two OpenAPI schemas named {name!r} differ")
        return {"$ref": f"#/components/schemas/{name}"}

    for methods in schema["paths"].values():
        for operation in methods.values():
            for media in operation.get("requestBody", {}).get("content", {}).values():
                body = media.get("schema", {})
                if "$defs" not in body and not ("title" in body and "properties" in body):
                    continue
                body = json.loads(json.dumps(body).replace('"#/$defs/',
                                                           '"#/components/schemas/'))
                for name, definition in body.pop("$defs", {}).items():
                    keep(name, definition)
                media["schema"] = keep(body["title"], body)


BEARER = "bearerAuth"
_SCOPE_SENTENCE = {"runtime": "Needs a token: any scope, a runtime token only on its own "
                              "deployment.",
                   "operator": "Needs an operator (or admin) token.",
                   "admin": "Needs an admin token."}


def _operations(app: FastAPI, schema: dict):
    """(route, method, operation) of every operation in the document."""
    from fastapi import routing
    from fastapi.openapi.utils import _get_api_route_for_openapi

    for context in routing.iter_route_contexts(app.routes):
        route = _get_api_route_for_openapi(context)
        if route is None or not route.include_in_schema:
            continue
        for method in sorted(route.methods):
            operation = schema["paths"].get(route.path_format, {}).get(method.lower())
            if operation is not None:
                yield route, method, operation


def _dependency_calls(dependant) -> list:
    calls = [dependant.call]
    for sub in dependant.dependencies:
        calls += _dependency_calls(sub)
    return calls


def _complete(route, method: str, operation: dict) -> None:
    calls = _dependency_calls(route.dependant)
    scopes = [call.required_scope for call in calls if hasattr(call, "required_scope")]
    bucket = policy_for(method, route.path).bucket
    needs_token = get_principal in calls or bool(scopes) or bucket == "read"
    responses = operation["responses"]
    operation["operationId"] = route.name
    if needs_token:
        operation["security"] = [{BEARER: []}]
        responses.setdefault("401", error_answer("no token, or one that is unknown or "
                                                 "revoked"))
        responses.setdefault("403", error_answer("the token's scope (or deployment) does "
                                                 "not allow this"))
    if "HTTPValidationError" in str(responses.get("422", "")) or \
            ("422" not in responses and ("parameters" in operation or "requestBody" in operation)):
        responses["422"] = VALIDATION_ERROR
    if "{" in route.path or _names_a_deployment(route):
        responses.setdefault("404", error_answer("what the path (or the deployment the request "
                                                 "names) refers to does not exist"))
    if method not in ("GET", "HEAD"):  # BodySizeLimit reads every other request's body
        responses.setdefault("413", error_answer("the request body is over this route's "
                                                 "size limit"))
    if takes_json_body(route):
        responses.setdefault("415", NOT_JSON)
    if bucket is not None:
        responses.setdefault("429", error_answer("rate limited: wait Retry-After seconds"))
    responses.setdefault("503", error_answer("the store (or Redis) is unavailable: wait "
                                             "Retry-After seconds"))
    for status, answer in responses.items():
        if status.isdigit() and int(status) >= 400 and "content" not in answer:
            answer["content"] = error_answer("")["content"]
        for media in answer.get("content", {}).values():
            if media.get("schema", {}).get("title", "").startswith("Response "):
                # FastAPI titles an unnamed answer after its path and method; generators
                # prefix the operation to the title ("SignalHistogramResponse")
                media["schema"]["title"] = "Response"
    description = (operation.get("description") or operation.get("summary", "")).strip()
    sentence = next((_SCOPE_SENTENCE[scope] for scope in scopes if scope in _SCOPE_SENTENCE),
                    "Needs a token." if needs_token else "")
    if sentence and sentence not in description:
        description = f"{description.rstrip('.')}. {sentence}"
    operation["description"] = description


def _names_a_deployment(route) -> bool:
    """Whether a query parameter or a field of the JSON body names a deployment (which may not
    exist: 404)."""
    if any(param.name == "deployment" for param in route.dependant.query_params):
        return True
    return any("deployment" in getattr(param.field_info.annotation, "model_fields", ())
               for param in route.dependant.body_params)


DOCS_ASSETS = "/docs/assets"


def serve_docs(app: FastAPI) -> None:
    """The interactive API reference at /docs, served entirely by this process: Swagger UI's
    files come from the installed swagger-ui bundle under /docs/assets, so the page works in
    an air-gapped cluster (FastAPI's own page would load them from a CDN). Needs the app
    created with `docs_url=None, redoc_url=None`."""
    import swagger_ui_bundle
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path),
              name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(
            openapi_url=app.openapi_url, title=f"{app.title}: API reference",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")
