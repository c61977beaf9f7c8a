"""kvbm's vLLM v1 KV connector.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvbmConnector",
                           "kv_connector_module_path": "kvbm_py.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {...}}'

See ``docs/vllm.md`` for the configuration keys.
"""

from kvbm_py.vllm.connector import KvbmConnector, KvbmMetadata

__all__ = ["KvbmConnector", "KvbmMetadata"]
