"""The OpenAI request bodies ``tsspec serve`` takes: each field checked, and a bad one answered with
an OpenAI-style error (``APIError``: status, message, type, the offending parameter, code).

Pure functions over the decoded JSON body; what needs the loaded model (the prompt's tokens, the
context they must fit) is ``Server``'s.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from ..errors import BadInput
from ..sampling import Sampler, SamplingParams

MAX_STOP_STRINGS = 4


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, type, offending parameter and code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def check_model(body: dict, model_id: str) -> None:
    """The request's ``model``: absent, "default" or the one served; else a 404."""
    name = body.get("model")
    if name is not None and name not in (model_id, "default"):
        raise APIError(404, f"model {name!r} is not served here (this server serves {model_id!r})",
                       type="invalid_request_error", param="model", code="model_not_found")

def sampling(body: dict) -> tuple[Sampler, int | None, list[str]]:
    """-> (sampler, the request's max_tokens or None when it gives none, stop strings)."""
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise APIError(400, "top_p must be in (0, 1]", param="top_p")
    # OpenAI's penalties, and the samplers llama.cpp's server also takes by these names
    presence = number(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    repeat = number(body, "repeat_penalty", 1.0, 0.0, 1e6)
    if repeat == 0.0:
        raise APIError(400, "repeat_penalty must be a number > 0", param="repeat_penalty")
    min_p = number(body, "min_p", 0.0, 0.0, 1.0)
    if min_p == 1.0:
        raise APIError(400, "min_p must be in [0, 1)", param="min_p")
    top_k = integer(body, "top_k", 0)
    repeat_last_n = integer(body, "repeat_last_n", 64)
    for key, unused in (("logprobs", (None, False)), ("top_logprobs", (None, 0)), ("echo", (None, False)),
                        ("best_of", (None, 1)), ("logit_bias", (None, {})), ("suffix", (None, ""))):
        if body.get(key) not in unused:  # asked for, and the answer would silently lack it
            raise APIError(400, f"{key} is not supported by tsspec serve: send the request without it",
                           param=key)
    seed = body.get("seed", 0)
    if seed is None:
        seed = 0
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise APIError(400, "seed must be a non-negative integer", param="seed")
    if body.get("tools") or body.get("functions"):
        raise APIError(400, "tool and function calling is not supported by tsspec serve: send the request "
                       "without 'tools'", param="tools")
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):  # 1.0 and true are not the count 1
        raise APIError(400, "only n = 1 is supported", param="n")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:  # {"max_tokens": null, "max_completion_tokens": 3} means 3
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 1):
        raise APIError(400, "max_tokens must be a positive integer", param="max_tokens")
    stop = body.get("stop")
    if stop is None or stop == "":  # "" is OpenAI's "no stop string"; 0, false or {} are not
        stop = []
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(x, str) and x for x in stop)):
        raise APIError(400, f"stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings",
                       param="stop")
    try:
        sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=seed, top_k=top_k, min_p=min_p,
                                         repeat_penalty=repeat, presence_penalty=presence,
                                         frequency_penalty=frequency, repeat_last_n=repeat_last_n))
    except (ValueError, BadInput) as e:
        raise APIError(400, str(e)) from None
    return sampler, max_tokens, stop

def streaming(body: dict) -> bool:
    """``stream``: a JSON boolean (or null); the string "false" is truthy and would stream."""
    value = body.get("stream")
    if value is not None and not isinstance(value, bool):
        raise APIError(400, "stream must be true or false", param="stream")
    return bool(value)


def number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= float(v) <= hi:
        raise APIError(400, f"{key} must be a number in [{lo:g}, {hi:g}]", param=key)
    return float(v)


def integer(body: dict, key: str, default: int) -> int:
    v = body.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise APIError(400, f"{key} must be a non-negative integer", param=key)
    return v
