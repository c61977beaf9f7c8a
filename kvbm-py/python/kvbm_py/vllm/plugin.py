"""vLLM's general-plugin hook: registers kvbm's connectors and spec by name.

The package declares ``register`` under the ``vllm.general_plugins`` entry
point group, which vLLM loads in every process it starts. With it,
``--kv-transfer-config '{"kv_connector": "KvbmConnector", ...}'`` needs no
``kv_connector_module_path``.
"""

from __future__ import annotations

#: The name vLLM's configuration uses for kvbm's connector.
CONNECTOR_NAME = "KvbmConnector"
#: The name of kvbm's backend of vLLM's offloading connector (every model,
#: hybrid ones included); see :mod:`kvbm_py.vllm.offload`.
OFFLOADING_CONNECTOR_NAME = "KvbmOffloadingConnector"
#: The name kvbm's offloading spec is registered under
#: (``"spec_name": "kvbm"`` with vLLM's ``OffloadingConnector``).
SPEC_NAME = "kvbm"


def register() -> None:
    """Registers kvbm's connectors with vLLM's connector factory (lazily:
    nothing of kvbm is imported until a connector is made) and kvbm's
    offloading spec as ``"spec_name": "kvbm"``. Safe to call more than
    once."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module, cls in (
        (CONNECTOR_NAME, "kvbm_py.vllm", "KvbmConnector"),
        (OFFLOADING_CONNECTOR_NAME, "kvbm_py.vllm.offload", "KvbmOffloadingConnector"),
    ):
        try:
            KVConnectorFactory.register_connector(name, module, cls)
        except ValueError:
            pass  # registered already (plugins load once per process, or more)
    register_spec()


def register_spec() -> None:
    """Registers kvbm's offloading spec with vLLM's offloading factory as
    :data:`SPEC_NAME` (lazily, safe to call more than once)."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    try:
        OffloadingSpecFactory.register_spec(SPEC_NAME, "kvbm_py.vllm.offload", "KvbmOffloadingSpec")
    except ValueError:
        pass
