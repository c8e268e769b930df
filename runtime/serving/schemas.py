"""Request shapes of the runtime server: the subset of OpenAI's completions and chat API that
clients use, with the bounds the engine accepts (a value outside them is a 422 naming the
field, never an error from deep inside torch)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

# A seed past 2**63-1 would surface as "Overflow when unpacking" from torch.
MAX_STOPS = 4
MAX_STOP_CHARS = 256
SEED_MAX = 2**63 - 1


class GenerationRequest(BaseModel):
    """What completions and chat requests share: sampling, length and stops."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    stream: bool = False
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    ignore_eos: bool = Field(default=False, description="extension: generate max_tokens tokens")
    # A malformed name is a 400 from serving/segments.py (which also reads the header and the
    # rules), not a 422 here: every source of a segment name is checked in one place.
    exitplane_segment: str | None = Field(default=None, description=(
        "extension: the request's traffic segment; see runtime/README.md"))

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOPS} non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string is at most {MAX_STOP_CHARS} characters")
        return stop

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _unsupported_logprobs(value: Any) -> Any:
    if value:
        raise ValueError("logprobs are not supported by this server")
    return value


_NoLogprobs = AfterValidator(_unsupported_logprobs)


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]
    logprobs: Annotated[int | None, Field(ge=0, le=5), _NoLogprobs] = None
    best_of: int | None = Field(default=None, ge=1, le=1)

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else "".join(self.prompt)

    def prompt_chars(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, str) else sum(map(len, self.prompt))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str


# what the chat template adds per message, roughly: counted so that many empty messages
# cannot slip a huge render past the character check
_MESSAGE_OVERHEAD_CHARS = 16


class ChatRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)
    logprobs: Annotated[bool | None, _NoLogprobs] = None
    top_logprobs: Annotated[int | None, Field(ge=0, le=20), _NoLogprobs] = None

    def prompt_chars(self) -> int:
        return sum(len(m.content) + _MESSAGE_OVERHEAD_CHARS for m in self.messages)
