"""``ServeConfig``: where the OpenAI-compatible endpoint listens, who may call it, and the bounds
every request is held to.

Safe by default: it listens on the loopback address, and a config that would listen on any
other address without an API key is refused when it is built, before a socket is opened.
"""

from __future__ import annotations

import ipaddress

from pydantic import Field, PositiveInt, SecretStr, model_validator

from engine_core.config import FrozenModel

__all__ = ["ServeConfig", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine: ``localhost`` or a loopback address."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


class ServeConfig(FrozenModel):
    """The endpoint's settings (``engine-core serve`` builds one from its flags)."""

    host: str = Field("127.0.0.1", description="Address to listen on (loopback by default).")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on; 0: any free one.")
    api_key: SecretStr | None = Field(
        None,
        description="Key every request must send as 'Authorization: Bearer KEY' (compared in "
        "constant time). Required to listen on any address but the loopback.",
    )
    model_name: str = Field(
        "engine-core",
        min_length=1,
        description="The model id /v1/models lists and requests must name.",
    )
    max_body_bytes: PositiveInt = Field(
        4 << 20, description="Largest request body, in bytes (413 past it)."
    )
    max_prompt_tokens: PositiveInt = Field(
        8192, description="Longest prompt, in tokens, after rendering (400 past it)."
    )
    max_tokens: PositiveInt = Field(
        1024, description="The most tokens a request may ask for per choice (400 past it)."
    )
    default_max_tokens: PositiveInt = Field(
        256, description="Tokens per choice when a request sets no max_tokens."
    )
    max_n: PositiveInt = Field(16, description="The most choices a request may ask for.")
    temperature: float | None = Field(
        None,
        ge=0,
        le=2,
        description="Pinned: requests that name no temperature sample at it, and one that names "
        "another is refused (a trainer computes its log-probs at this one). None: the "
        "request's own (1.0 unset).",
    )
    max_sessions: PositiveInt = Field(
        4096, description="Sessions open at once (429 for a new one past it)."
    )
    max_session_calls: PositiveInt = Field(
        1024, description="Calls one session may record (400 for the next one past it)."
    )

    @model_validator(mode="after")
    def _safe(self) -> ServeConfig:
        if not is_loopback(self.host) and self.api_key is None:
            raise ValueError(
                f"listening on {self.host!r} (not a loopback address) without an API key would "
                f"let anyone who reaches this machine sample from the model; set an API key "
                f"(--api-key KEY) or listen on 127.0.0.1."
            )
        if self.api_key is not None and not self.api_key.get_secret_value():
            raise ValueError("api_key is empty; give a non-empty key or none (loopback only).")
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(
                f"default_max_tokens={self.default_max_tokens} exceeds max_tokens="
                f"{self.max_tokens}; lower it or raise max_tokens."
            )
        return self
