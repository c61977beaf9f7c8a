"""vLLM's general-plugin hook: registers kvbm's connector by name.

The package declares ``register`` under the ``vllm.general_plugins`` entry
point group, which vLLM loads in every process it starts. With it,
``--kv-transfer-config '{"kv_connector": "KvbmConnector", ...}'`` needs no
``kv_connector_module_path``.
"""

from __future__ import annotations

#: The name vLLM's configuration uses for kvbm's connector.
CONNECTOR_NAME = "KvbmConnector"


def register() -> None:
    """Registers :class:`kvbm_py.vllm.KvbmConnector` with vLLM's connector
    factory (lazily: nothing of kvbm is imported until a connector is made).
    Safe to call more than once."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvbm_py.vllm", "KvbmConnector")
    except ValueError:
        pass  # registered already (plugins load once per process, or more)
