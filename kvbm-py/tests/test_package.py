"""The package alone: imports without vLLM, configuration sources, hash
keys, the exception classes, and KV tensors kvbm takes or refuses at
start-up."""

import ctypes
import gc
import os
import pickle
import subprocess
import sys
import weakref

import pytest
import torch

import kvbm_py
from kvbm_py.config import GIB, KvbmConfig, SchedulerConfig, WorkerConfig


def test_imports_without_vllm():
    code = (
        "import sys, kvbm_py, kvbm_py.config; "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules; "
        "print(kvbm_py.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == kvbm_py.__version__


def test_block_hash_keys_are_the_first_eight_bytes_little_endian():
    digest = bytes(range(32))
    assert kvbm_py.sequence_hash(digest) == int.from_bytes(digest[:8], "little")
    with pytest.raises(kvbm_py.InvalidArgumentError):
        kvbm_py.sequence_hash(b"short")


def test_errors_are_one_hierarchy_that_keeps_the_builtin_bases():
    for name in ("InvalidArgumentError", "TransferError", "ClosedError", "KvbmTimeoutError"):
        cls = getattr(kvbm_py, name)
        assert issubclass(cls, kvbm_py.KvbmError) and cls.__module__ == "kvbm_py._kvbm", name
    assert issubclass(kvbm_py.InvalidArgumentError, ValueError)
    assert issubclass(kvbm_py.KvbmTimeoutError, TimeoutError)
    assert not issubclass(kvbm_py.TransferError, ValueError)
    # Raised by Rust and by the package's Python alike; they cross process
    # boundaries (vLLM pickles a worker's exception).
    with pytest.raises(kvbm_py.InvalidArgumentError) as err:
        kvbm_py.sequence_hash(b"")
    again = pickle.loads(pickle.dumps(err.value))
    assert type(again) is kvbm_py.InvalidArgumentError and str(again) == str(err.value)
    with pytest.raises(kvbm_py.InvalidArgumentError, match="unknown configuration key"):
        KvbmConfig.from_sources({"cpu_cache": 1}, {})


def test_config_reads_extra_then_environment_then_defaults():
    env = {
        "DYN_KVBM_CPU_CACHE_GB": "2",
        "DYN_KVBM_DISK_CACHE_GB": "8",
        "DYN_KVBM_DISK_CACHE_DIR": "/data/kvbm",
        "KVBM_LOAD_ASYNC": "false",
    }
    c = KvbmConfig.from_sources({"cpu_cache_gb": 0.5}, env)
    assert c.cpu_cache_gb == 0.5  # extra wins
    assert (c.disk_cache_gb, c.disk_cache_dir, c.load_async) == (8.0, "/data/kvbm", False)
    # kvbm's own variable wins over the Dynamo alias.
    c = KvbmConfig.from_sources({}, {"KVBM_CPU_CACHE_GB": "3", "DYN_KVBM_CPU_CACHE_GB": "2"})
    assert c.cpu_cache_gb == 3.0
    d = KvbmConfig.from_sources({}, {})
    assert (d.cpu_cache_gb, d.disk_cache_gb, d.offload, d.load_async) == (4.0, 0.0, "eager", True)
    assert d.endpoint_for("abc").startswith("ipc://")
    with pytest.raises(ValueError, match="unknown configuration key"):
        KvbmConfig.from_sources({"test_corupt_onboard": True}, {})
    with pytest.raises(ValueError, match="offload"):
        KvbmConfig.from_sources({"offload": "sometimes"}, {})
    with pytest.raises(ValueError, match="number"):
        KvbmConfig.from_sources({"cpu_cache_gb": "lots"}, {})
    assert GIB == 1 << 30
    # A kept G2 is off by default; it keeps the G3 behind it too.
    assert not d.cpu_cache_keep
    assert KvbmConfig.from_sources({}, {"KVBM_CPU_CACHE_KEEP": "1"}).cpu_cache_keep
    with pytest.raises(ValueError, match="disk_cache_keep"):
        KvbmConfig.from_sources({"cpu_cache_keep": True, "disk_cache_gb": 1, "disk_cache_keep": False}, {})


@pytest.fixture(autouse=True)
def _secret_in_tmp(tmp_path, monkeypatch):
    # Workers built here publish the instance secret under tmp_path.
    monkeypatch.setattr(sys.modules[__name__], "_SECRET", str(tmp_path / "instance.secret"))


_SECRET = ""


def _config(**kwargs):
    return WorkerConfig("ipc:///nonexistent/kvbm", 0, 1, _SECRET, **kwargs)


def _worker(tensors, num_blocks):
    return kvbm_py.Worker(_config(), tensors, num_blocks)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_CAPSULE_NAME = b"dltensor"
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeDeviceTensor:
    """A DLPack producer of a bf16 tensor said to be in CUDA memory at a
    made-up address, without strides (compact): kvbm's reading of a
    capsule, without a GPU. Owns the structures its capsule points at."""

    def __init__(self, shape, device_id=0, addr=0x10000):
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.managed = _DLManagedTensor()
        t = self.managed.dl_tensor
        t.data, t.device, t.ndim = addr, _DLDevice(2, device_id), len(shape)
        t.dtype = _DLDataType(4, 16, 1)
        t.shape = self.shape

    def __dlpack__(self):
        return _capsule_new(ctypes.addressof(self.managed), _CAPSULE_NAME, None)


def test_unknown_tensor_shapes_are_refused_at_start_up():
    t = torch.zeros(3, 10, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="unsupported KV tensor"):
        _worker([t], 10)


def test_tensors_kvbm_cannot_address_exactly_are_refused():
    # Every token row padded: a (block, K/V) chunk is not one byte range.
    base = torch.zeros(10, 2, 16, 256, dtype=torch.float16)
    t = base[..., :128]
    with pytest.raises(ValueError, match="densely"):
        _worker([t, t], 10)
    # Layers of different shapes.
    a = torch.zeros(10, 2, 16, 128, dtype=torch.float16)
    b = torch.zeros(10, 2, 16, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="share shape"):
        _worker([a, b], 10)


def test_gpu_tensors_without_a_gpu_are_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    # The wheel has CUDA support compiled in; libcuda is only looked for
    # now, and its absence is an error, not a crash.
    with pytest.raises(kvbm_py.KvbmError, match="(?i)cuda"):
        _worker([FakeDeviceTensor([2, 4, 16, 2, 64])], 4)


def test_tensors_are_read_through_dlpack_and_kept_alive_while_used(tmp_path):
    # The worker reads address, shape, strides, element size and device
    # from the tensor and holds it: the caller may drop its reference.
    t = torch.zeros(4, 2, 16, 128, dtype=torch.float16)
    alive = weakref.ref(t)
    config = WorkerConfig(f"ipc://{tmp_path}/nobody.sock", 0, 1, _SECRET, leader_timeout_s=0.5)
    w = kvbm_py.Worker(config, [t], 4)
    assert (w.num_blocks, w.block_bytes) == (4, 2 * 16 * 128 * 2)
    del t
    gc.collect()
    assert alive() is not None, "the worker let go of a tensor it addresses"
    # Nobody leads: the worker gives up, with a typed error, and lets go.
    assert w.join(30.0)
    assert isinstance(w.exception(), kvbm_py.ClosedError), w.exception()
    assert "leader" in str(w.exception())
    del w
    gc.collect()
    assert alive() is None


def test_tensor_intake_refuses_what_it_cannot_read():
    with pytest.raises(kvbm_py.InvalidArgumentError, match="__dlpack__"):
        _worker([[0] * 4], 4)
    with pytest.raises(kvbm_py.InvalidArgumentError, match="no KV tensors"):
        _worker([], 4)
    a = torch.zeros(4, 2, 16, 128, dtype=torch.float16)
    b = torch.zeros(4, 2, 16, 128, dtype=torch.float32)
    with pytest.raises(kvbm_py.InvalidArgumentError, match="elements of 4 bytes"):
        _worker([a, b], 4)
    with pytest.raises(kvbm_py.InvalidArgumentError, match="memory"):
        _worker([a, FakeDeviceTensor([4, 2, 16, 128])], 4)
    with pytest.raises(kvbm_py.InvalidArgumentError, match="rank 1 of a world of 1"):
        kvbm_py.Worker(WorkerConfig("ipc:///nonexistent/kvbm", 1, 1, _SECRET), [a], 4)
    if not kvbm_py._kvbm.TEST_HOOKS:
        with pytest.raises(kvbm_py.InvalidArgumentError, match="test-hooks"):
            kvbm_py.Worker(_config(transfer_delay_ms=5), [a], 4)


def test_the_spec_worker_takes_page_tensors_and_copies_them():
    # Two layers' (blocks, page bytes) views of one KV cache group, rows a
    # block stride apart (wider than the page): stored into host slots and
    # loaded back into other blocks byte for byte.
    layers = [torch.randint(-128, 127, (8, 96), dtype=torch.int8)[:, :64] for _ in range(2)]
    worker = kvbm_py._kvbm.PageWorker([(layers, 64)], 8, 4, 128)
    before = [t[[1, 2]].clone() for t in layers]
    worker.store(1, [(0, 1, 0), (0, 2, 1)])
    worker.wait([1])
    assert [r[1] for r in worker.finished()] == [True]
    worker.load(2, [(0, 5, 0), (0, 6, 1)])
    worker.wait([2])
    ((job, ok, nbytes, _, failed, error),) = worker.finished()
    assert (job, ok, nbytes, failed, error) == (2, True, 4 * 64, [], None)
    for t, want in zip(layers, before):
        assert torch.equal(t[[5, 6]], want)
    # Views kvbm cannot address as pages are refused, naming the group.
    with pytest.raises(kvbm_py.InvalidArgumentError, match="group 0"):
        kvbm_py._kvbm.PageWorker([([torch.zeros(8, 64, dtype=torch.int8).t()], 8)], 8, 4, 128)
    with pytest.raises(kvbm_py.InvalidArgumentError, match="mixes block strides"):
        kvbm_py._kvbm.PageWorker([([layers[0], torch.zeros(8, 64, dtype=torch.int8)], 64)], 8, 4, 128)


def test_worker_config_is_derived_from_the_user_config():
    c = KvbmConfig.from_sources({"test_transfer_delay_ms": 7}, {})
    w = WorkerConfig.for_engine(c, "engine-a", 1, 2, instance=9, g3_dir="/g3")
    assert (w.endpoint, w.secret_file) == (c.endpoint_for("engine-a"), c.secret_file_for("engine-a"))
    assert (w.rank, w.world_size, w.instance, w.g3_dir, w.transfer_delay_ms) == (1, 2, 9, "/g3", 7)
    assert w.kept_identity is None and w.leader_timeout_s == 600.0


def test_vllm_finds_the_connector_by_name_after_loading_plugins():
    # The wheel declares a `vllm.general_plugins` entry point: once vLLM
    # loaded its plugins, "KvbmConnector" needs no module path.
    code = (
        "from importlib.metadata import entry_points; "
        "assert any(e.value == 'kvbm_py.vllm.plugin:register' "
        "for e in entry_points(group='vllm.general_plugins')); "
        "from vllm.plugins import load_general_plugins; load_general_plugins(); "
        "from vllm.config import KVTransferConfig; "
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory; "
        "c = KVConnectorFactory.get_connector_class("
        "KVTransferConfig(kv_connector='KvbmConnector', kv_role='kv_both')); "
        "print(c.__module__, c.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split()[-2:] == ["kvbm_py.vllm.connector", "KvbmConnector"], out.stdout


def test_metrics_port_is_read_from_extra_or_environment():
    assert KvbmConfig.from_sources({}, {}).metrics_port == 0
    assert KvbmConfig.from_sources({}, {"DYN_KVBM_METRICS_PORT": "9100"}).metrics_port == 9100
    assert KvbmConfig.from_sources({"metrics_port": 9200}, {"KVBM_METRICS_PORT": "9100"}).metrics_port == 9200
    with pytest.raises(ValueError, match="TCP port"):
        KvbmConfig.from_sources({"metrics_port": 70000}, {})


# A scheduler and one worker over host tensors, started and shut down.
_START_STOP = """
import tempfile, torch, kvbm_py
from kvbm_py.config import SchedulerConfig, WorkerConfig
with tempfile.TemporaryDirectory() as d:
    ep = f"ipc://{d}/leader.sock"
    layers = [torch.zeros(4, 2, 16, 128, dtype=torch.float16) for _ in range(2)]
    w = kvbm_py.Worker(WorkerConfig(ep, 0, 1, f"{d}/secret"), layers, 4)
    s = kvbm_py.Scheduler(SchedulerConfig(ep, 1, 16, secret_file=f"{d}/secret", g2_bytes=4 * 16384,
                                          handshake_timeout_s=30))
    s.shutdown()
    assert w.join(10.0)
"""


@pytest.mark.parametrize("spec", [None, "info", "kvbm_dist=info", "kvbm_dist=[bad"])
def test_kvbm_log_lines_reach_stderr_filtered_by_kvbm_log(spec):
    env = {k: v for k, v in os.environ.items() if k != "KVBM_LOG"}
    if spec is not None:
        env["KVBM_LOG"] = spec
    out = subprocess.run([sys.executable, "-c", _START_STOP], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    verbose = spec in ("info", "kvbm_dist=info")
    # The worker's hello and the leader's handshake are info lines.
    assert ("hello sent" in out.stderr) == verbose, out.stderr
    assert (" INFO " in out.stderr) == verbose, out.stderr
    if spec == "kvbm_dist=[bad":
        assert "KVBM_LOG" in out.stderr and "not a log filter" in out.stderr, out.stderr


def test_a_misspelled_key_is_refused_naming_the_closest_one():
    with pytest.raises(ValueError, match=r"unknown configuration key 'cpu_cache_gbs'; did you mean 'cpu_cache_gb'\?"):
        KvbmConfig.from_sources({"cpu_cache_gbs": 1}, {})
    with pytest.raises(ValueError, match=r"'disk_cache_gb'"):
        KvbmConfig.from_sources({"disk_cache_size_gb": 1}, {})
    # Nothing close: the known keys are listed.
    with pytest.raises(ValueError, match=r"unknown configuration key 'zzz'; known keys: admission, "):
        KvbmConfig.from_sources({"zzz": 1}, {})


def test_sizes_kvbm_cannot_hold_name_the_key_the_value_and_the_limit():
    for value in (1e12, "1e30", float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"kvbm: cpu_cache_gb=") as e:
            KvbmConfig.from_sources({"cpu_cache_gb": value}, {})
        assert "limit" in str(e.value) or "finite" in str(e.value), e.value
    c = KvbmConfig.from_sources({"disk_cache_gb": 9e9}, {})
    assert c.tier_bytes("disk_cache_gb", 1) == int(9e9 * GIB)
    with pytest.raises(
        ValueError,
        match=r"disk_cache_gb=9000000000.0 GiB per worker is larger than the limit of \d+ GiB with 4 workers",
    ):
        c.tier_bytes("disk_cache_gb", 4)


def test_a_tier_larger_than_its_block_index_is_refused_at_start_up():
    # 1e6 GiB of 32 KiB blocks is more blocks than a tier indexes: an
    # error naming the key, not a quietly smaller tier.
    from kvbm_py.vllm.scheduler_side import naming_the_size_key

    code = _START_STOP.replace("g2_bytes=4 * 16384", "g2_bytes=4 * 16384, g3_bytes=10**6 * 2**30")
    assert code != _START_STOP
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    prefix = "kvbm_py._kvbm.InvalidArgumentError: "
    assert prefix + "G3 of " in out.stderr and "blocks a tier holds: at most" in out.stderr, out.stderr[-2000:]
    message = out.stderr.strip().splitlines()[-1].removeprefix(prefix)
    config = KvbmConfig.from_sources({"disk_cache_gb": 1e6}, {})
    named = naming_the_size_key(kvbm_py.InvalidArgumentError(message), config)
    assert str(named).startswith("kvbm: disk_cache_gb=1000000.0 GiB per worker: G3 of "), named


_METRICS_HOST = """
import kvbm_py
port = kvbm_py.start_metrics_server(0{host})
want = "{want}:%04X" % port
rows = [l.split()[1] for l in open("/proc/net/tcp").read().splitlines()[1:]]
assert want in rows, (want, rows)
"""


def test_the_metrics_exporter_listens_on_this_host_unless_told():
    assert KvbmConfig.from_sources({}, {}).metrics_host == "127.0.0.1"
    assert KvbmConfig.from_sources({}, {"KVBM_METRICS_HOST": "0.0.0.0"}).metrics_host == "0.0.0.0"
    for host, want in (("", "0100007F"), (", '0.0.0.0'", "00000000")):
        code = _METRICS_HOST.format(host=host, want=want)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]


def test_connector_log_lines_appear_where_vllms_do():
    # vLLM configures its `vllm` logger (handler on stdout, INFO) as an
    # engine starts, as below; the connector's INFO lines must come out
    # through it without any set-up of their own.
    code = (
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging_if_needed\n"
        "configure_logging_if_needed(LoggingConfig())\n"
        "from kvbm_py.vllm.common import log\n"
        "log.info('kvbm: caches ready (test line)')\n"
        "log.debug('kvbm: not at INFO')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [l for l in (out.stdout + out.stderr).splitlines() if "kvbm:" in l]
    assert len(lines) == 1 and "INFO" in lines[0] and "caches ready (test line)" in lines[0], lines


def test_scheduler_config_is_derived_from_the_user_config():
    c = KvbmConfig.from_sources({"cpu_cache_gb": 0.5, "disk_cache_gb": 1, "admission": "all", "verify": True}, {})
    s = SchedulerConfig.for_engine(c, "engine-a", 2, 16, instance=9, history_path="/h")
    assert (s.endpoint, s.secret_file) == (c.endpoint_for("engine-a"), c.secret_file_for("engine-a"))
    assert (s.world_size, s.block_size, s.instance, s.history_path) == (2, 16, 9, "/h")
    # Budgets are summed over the workers.
    assert (s.g2_bytes, s.g3_bytes) == (GIB, 2 * GIB)
    assert (s.admission, s.verify, s.offload_in_flight, s.g3_staging_bytes) == ("all", True, None, None)


def test_g4_keys_are_read_checked_and_derived():
    # No G4 unless a master is named.
    assert KvbmConfig.from_sources({}, {}).g4_store() is None
    c = KvbmConfig.from_sources({"g4_master": "10.0.0.1:50051"}, {"DYN_KVBM_G4_SEGMENT_GB": "2"})
    g4 = c.g4_store()
    assert g4 is not None
    assert (g4.master, g4.metadata) == ("10.0.0.1:50051", "http://10.0.0.1:8080/metadata")
    assert (g4.protocol, g4.segment_bytes, c.g4_publish) == ("tcp", 2 * GIB, "admissions")
    assert g4.hostname != "127.0.0.1"
    # A master on loopback is reached, and reaches back, on loopback.
    local = KvbmConfig.from_sources({}, {"KVBM_G4_MASTER": "127.0.0.1:7", "KVBM_G4_PUBLISH": "evictions"})
    local_g4 = local.g4_store()
    assert local_g4 is not None and local_g4.hostname == "127.0.0.1"
    assert local.g4_publish == "evictions"
    for bad, match in (
        ({"g4_master": "nohost"}, "host:port"),
        ({"g4_master": "h:99999"}, "host:port"),
        ({"g4_protocol": "udp"}, "g4_protocol"),
        ({"g4_publish": "sometimes"}, "g4_publish"),
        ({"g4_metadata": "h:8080"}, "g4_metadata"),
        ({"g4_segment_gb": -1}, "g4_segment_gb"),
    ):
        with pytest.raises(ValueError, match=match):
            KvbmConfig.from_sources(bad, {})
