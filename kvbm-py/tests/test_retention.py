"""Parsing of the ``kvbm_retention`` key of vLLM's ``kv_transfer_params``
(needs neither vLLM nor a built extension)."""

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).parents[1] / "python" / "kvbm_py" / "vllm" / "retention.py"
_SPEC = importlib.util.spec_from_file_location("kvbm_retention_under_test", _PATH)
retention = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(retention)


@pytest.mark.parametrize(
    "params, hint",
    [
        (None, None),
        ({}, None),
        ({"other": 1}, None),
        ({"kvbm_retention": "done"}, "done"),
        ({"kvbm_retention": {"returns_within_s": 30}}, 30.0),
        ({"kvbm_retention": {"returns_within_s": 0.5}}, 0.5),
        # Malformed: ignored, never an error.
        ({"kvbm_retention": "later"}, None),
        ({"kvbm_retention": {"returns_within_s": -1}}, None),
        ({"kvbm_retention": {"returns_within_s": True}}, None),
        ({"kvbm_retention": {"returns_within_s": "30"}}, None),
        ({"kvbm_retention": {"returns_within_s": 30, "x": 1}}, None),
        ({"kvbm_retention": 30}, None),
    ],
)
def test_retention_of(params, hint):
    assert retention.retention_of(params) == hint
