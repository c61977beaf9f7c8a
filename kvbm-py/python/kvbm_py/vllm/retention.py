"""The retention hint a request carries in vLLM's ``kv_transfer_params``.

``{"kvbm_retention": {"returns_within_s": 30}}`` says a follow-up that
carries this request's prefix is expected within 30 seconds (a tool call is
running); ``{"kvbm_retention": "done"}`` says nothing will come back (the
conversation was closed). kvbm ranks the request's blocks by it in every tier.
"""

from __future__ import annotations

from typing import Any

from kvbm_py.vllm.common import log

#: The key in ``kv_transfer_params``.
KEY = "kvbm_retention"


def retention_of(params: Any) -> float | str | None:
    """The hint in ``params`` as the scheduler binding takes it (seconds, or
    ``"done"``), or ``None`` when there is none. A malformed hint is logged
    and ignored: a hint never fails a request."""
    if not isinstance(params, dict) or KEY not in params:
        return None
    value = params[KEY]
    if value == "done":
        return "done"
    if isinstance(value, dict) and set(value) == {"returns_within_s"}:
        seconds = value["returns_within_s"]
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds < 1e9:
            return float(seconds)
    log.warning("kvbm: ignoring malformed %s %r", KEY, value)
    return None
