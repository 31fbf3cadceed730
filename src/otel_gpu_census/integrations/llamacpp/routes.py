"""Which requests are model work (a GenAI span, GPU attribution) and which are plain HTTP."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LLAMACPP = "llama.cpp"
OLLAMA = "ollama"


@dataclass(frozen=True)
class Route:
    operation: str          # gen_ai.operation.name
    provider: str           # gen_ai.provider.name
    body_kind: str          # how to read an answer without a content type: "json" or "ndjson"


_CHAT = "chat"
_TEXT = "text_completion"
_EMBED = "embeddings"

# POST endpoints of llama-server b11434 (tools/server/server.cpp) and Ollama that run the model.
GENAI_ROUTES = {
    "/completion": Route(_TEXT, LLAMACPP, "json"),
    "/completions": Route(_TEXT, LLAMACPP, "json"),
    "/v1/completions": Route(_TEXT, LLAMACPP, "json"),
    "/infill": Route(_TEXT, LLAMACPP, "json"),
    "/chat/completions": Route(_CHAT, LLAMACPP, "json"),
    "/v1/chat/completions": Route(_CHAT, LLAMACPP, "json"),
    "/v1/responses": Route(_CHAT, LLAMACPP, "json"),
    "/v1/messages": Route(_CHAT, LLAMACPP, "json"),
    "/embedding": Route(_EMBED, LLAMACPP, "json"),
    "/embeddings": Route(_EMBED, LLAMACPP, "json"),
    "/v1/embeddings": Route(_EMBED, LLAMACPP, "json"),
    "/rerank": Route("rerank", LLAMACPP, "json"),
    "/reranking": Route("rerank", LLAMACPP, "json"),
    "/v1/rerank": Route("rerank", LLAMACPP, "json"),
    "/v1/reranking": Route("rerank", LLAMACPP, "json"),
    "/api/generate": Route(_TEXT, OLLAMA, "ndjson"),
    "/api/chat": Route(_CHAT, OLLAMA, "ndjson"),
    "/api/embed": Route(_EMBED, OLLAMA, "json"),
    "/api/embeddings": Route(_EMBED, OLLAMA, "json"),
}

# Polled by health checks and scrapers: forwarded without a span, so traces are not flooded.
UNTRACED = {"/health", "/v1/health", "/metrics", "/api/version", "/api/ps"}

# llama-server's and Ollama's other fixed paths: a plain span is named `{method} {http.route}` for these and
# `{method}` for any other path (a client's arbitrary paths must not each become a span name).
PLAIN_ROUTES = frozenset({"/", "/slots", "/props", "/models", "/v1/models", "/tokenize", "/detokenize",
                          "/apply-template", "/lora-adapters", "/api/tags", "/api/show"}) | frozenset(GENAI_ROUTES)


def _unprefixed(path: str, api_prefix: str) -> str:
    if api_prefix and path.startswith(api_prefix):
        return path[len(api_prefix):] or "/"
    return path


def http_route(path: str, api_prefix: str = "") -> Optional[str]:
    """The route of a plain request, as the upstream's API names it (with the prefix), or None."""
    return path if _unprefixed(path, api_prefix) in PLAIN_ROUTES | UNTRACED else None


def classify(method: str, path: str, api_prefix: str = "") -> Optional[Route]:
    """The GenAI route of a request, or None for a plain one."""
    if method != "POST":
        return None
    if api_prefix and path.startswith(api_prefix):
        path = path[len(api_prefix):] or "/"
    return GENAI_ROUTES.get(path)


def untraced(path: str, api_prefix: str = "") -> bool:
    if api_prefix and path.startswith(api_prefix):
        path = path[len(api_prefix):] or "/"
    return path in UNTRACED
