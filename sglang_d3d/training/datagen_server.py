"""A serving engine as the datagen target: any OpenAI-compatible server (SGLang, vLLM, `d3d serve`).

Prompts go out as token ids (the target folder's chat template, tokenized here), so the stored
prompt is exactly what the server saw. Answers come back in one of three ways (`TokenIdMode`):
  completions  /v1/completions with `return_token_ids: true`: the choice's `token_ids`
               (vLLM's field; `d3d serve` has it too)
  generate     SGLang's native /generate with `input_ids`: `output_ids` of the response
  text         /v1/completions, text only: re-tokenized here with a round-trip check
               (decode(encode(text)) == text); the mismatches are counted and reported
`auto` asks the server for token ids in that order and falls back to text.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass


class TokenIdMode(enum.Enum):
    AUTO = "auto"
    COMPLETIONS = "completions"
    GENERATE = "generate"
    TEXT = "text"


class ServerError(RuntimeError):
    """The server is down, or failed a request; the message is one line."""


class BadRequest(ServerError):
    """The server refused a request as invalid (HTTP 400/422)."""


@dataclass(frozen=True)
class Reply:
    text: str
    token_ids: list[int] | None  # None: the server returned text only
    finished: bool  # ended by EOS (or a stop token), not by the length limit
    prompt_tokens: int | None  # as the server counted them, where it says


def _one_line(text: object, limit: int = 300) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def api_root(url: str) -> str:
    """'http://h:p', 'http://h:p/' or 'http://h:p/v1' -> 'http://h:p'."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class ServerClient:
    """Async requests to one server; `complete` is safe to call concurrently."""

    def __init__(self, url: str, api_key: str | None = None, retries: int = 2,
                 timeout: float = 600.0) -> None:
        try:
            import httpx
            import openai
        except ImportError as e:
            raise ServerError(f"--server needs the openai and httpx packages ({e}): "
                              "pip install '.[datagen]' in a clone of sglang-d3d") from e

        api_key = api_key or os.environ.get("OPENAI_API_KEY")
        self.root = api_root(url)
        self.model: str | None = None
        self.max_model_len: int | None = None
        self.mode = TokenIdMode.TEXT
        self._openai = openai.AsyncOpenAI(base_url=self.root + "/v1", api_key=api_key or "EMPTY",
                                          max_retries=retries, timeout=timeout)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.root, timeout=timeout, headers=headers)

    async def close(self) -> None:
        await self._openai.close()
        await self._http.aclose()

    async def open(self, model: str | None = None) -> None:
        """Read the served model's name and context length from /v1/models."""
        models = await self._guard(self._openai.models.list())
        cards = list(models.data)
        if not cards:
            raise ServerError(f"{self.root}/v1/models lists no model")
        names = [c.id for c in cards]
        if model is not None and model not in names:
            raise ServerError(f"the server serves {names}, not {model!r}")
        card = cards[names.index(model)] if model else cards[0]
        self.model = card.id
        extra = card.model_extra or {}
        self.max_model_len = extra.get("max_model_len") or extra.get("context_length")

    async def complete(self, prompt: list[int] | str, max_new: int, temperature: float = 0.0,
                       seed: int | None = None, mode: TokenIdMode | None = None) -> Reply:
        mode = mode or self.mode
        if mode is TokenIdMode.GENERATE:
            return await self._generate(prompt, max_new, temperature, seed)
        extra = {"return_token_ids": True} if mode is TokenIdMode.COMPLETIONS else None
        r = await self._guard(self._openai.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_new, temperature=temperature,
            seed=seed if temperature > 0 else None, extra_body=extra,
        ))  # fmt: skip
        c = r.choices[0]
        ids = (c.model_extra or {}).get("token_ids") if mode is TokenIdMode.COMPLETIONS else None
        usage = r.usage.prompt_tokens if r.usage is not None else None
        return Reply(c.text, list(ids) if ids is not None else None, c.finish_reason == "stop", usage)

    async def _generate(self, prompt, max_new: int, temperature: float, seed) -> Reply:
        import httpx

        params = {"max_new_tokens": max_new, "temperature": temperature}
        if seed is not None and temperature > 0:
            params["sampling_seed"] = seed
        body = {("text" if isinstance(prompt, str) else "input_ids"): prompt,
                "sampling_params": params}
        try:
            resp = await self._http.post("/generate", json=body)
        except httpx.TransportError as e:
            raise ServerError(f"cannot reach {self.root}: {_one_line(e) or type(e).__name__}") from e
        if resp.status_code != 200:
            cls = BadRequest if resp.status_code in (400, 422) else ServerError
            raise cls(f"{self.root}/generate answered {resp.status_code}: {_one_line(resp.text)}")
        out = resp.json()
        meta = out.get("meta_info", {})
        ids = out.get("output_ids", meta.get("output_ids"))
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind == "abort":
            raise ServerError(f"{self.root}/generate aborted the request: {_one_line(finish)}")
        return Reply(out.get("text", ""), list(ids) if ids is not None else None, kind == "stop",
                     meta.get("prompt_tokens"))

    async def _guard(self, call):
        """The openai client's errors as one-line ServerErrors (it has already retried)."""
        import openai

        try:
            return await call
        except openai.APIConnectionError as e:
            cause = e.__cause__ or e
            raise ServerError(f"cannot reach {self.root}: {_one_line(cause) or type(cause).__name__}"
                              ) from e
        except openai.APIStatusError as e:
            cls = BadRequest if e.status_code in (400, 422) else ServerError
            raise cls(f"{self.root} answered {e.status_code}: {_one_line(e.message)}") from e

    async def detect_mode(self, probe_ids: list[int]) -> TokenIdMode:
        """The first way this server returns token ids (completions, then generate), else text."""
        r = await self.complete(probe_ids, 2, mode=TokenIdMode.COMPLETIONS)
        if r.token_ids is not None:
            return TokenIdMode.COMPLETIONS
        try:
            r = await self.complete(probe_ids, 2, mode=TokenIdMode.GENERATE)
            if r.token_ids is not None:
                return TokenIdMode.GENERATE
        except ServerError:  # no SGLang route here
            pass
        return TokenIdMode.TEXT
