"""GPU telemetry through NVML: read by UUID, None wherever NVML, the GPU or one query is missing,
and the columns and suspect-reasons a point's row gets from its start and end snapshots."""

import sys
import types
from collections import namedtuple

import pytest
import torch
from conftest import requires_cuda

from lorabench.runtime import env, telemetry
from lorabench.runtime.telemetry import Gpu, Snapshot, point_columns, suspect

UUID = "GPU-12345678-1234-1234-1234-123456789abc"
Memory = namedtuple("Memory", "total free used")


def fake_pynvml(devices: dict | None = None, init_error: bool = False, unsupported=(), old: bool = False):
    """A module standing in for pynvml over ``devices`` ({uuid: {query: value}}); ``unsupported``
    queries raise NVMLError, ``old`` lacks the clocks-event name (pynvml before 12.535) and answers bytes."""
    devices = {UUID: dict(name="NVIDIA H200", sm=1980, mem=2619, temp=41, power_mw=123456, reasons=0x1,
                          free=100 * 2**30)} if devices is None else devices
    m = types.ModuleType("pynvml")
    m.calls = {"init": 0}

    class NVMLError(Exception):
        pass

    m.NVMLError = NVMLError
    m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM, m.NVML_TEMPERATURE_GPU = 1, 2, 0
    text = (lambda s: s.encode()) if old else (lambda s: s)

    def init():
        m.calls["init"] += 1
        if init_error:
            raise NVMLError("Driver Not Loaded")

    def query(name, key):
        def fn(handle, *args):
            if name in unsupported:
                raise NVMLError("Not Supported")
            return devices[handle][key(args) if callable(key) else key]
        return fn

    def by_uuid(uuid):
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        if uuid not in devices:
            raise NVMLError("Not Found")
        return uuid

    m.nvmlInit = init
    m.nvmlDeviceGetHandleByUUID = by_uuid
    m.nvmlDeviceGetCount = lambda: len(devices)
    m.nvmlDeviceGetHandleByIndex = lambda i: list(devices)[i]
    m.nvmlDeviceGetUUID = lambda h: text(h)
    m.nvmlDeviceGetName = lambda h: text(devices[h]["name"])
    m.nvmlSystemGetDriverVersion = lambda: text("550.54.15")
    m.nvmlDeviceGetClockInfo = query("clock", lambda args: {1: "sm", 2: "mem"}[args[0]])
    m.nvmlDeviceGetTemperature = query("temp", "temp")
    m.nvmlDeviceGetPowerUsage = query("power", "power_mw")
    m.nvmlDeviceGetCurrentClocksThrottleReasons = query("reasons", "reasons")
    if not old:
        m.nvmlDeviceGetCurrentClocksEventReasons = query("reasons", "reasons")
    m.nvmlDeviceGetMemoryInfo = lambda h: Memory(80 * 2**30, devices[h]["free"], 0)
    return m


@pytest.fixture
def nvml(monkeypatch):
    """Install a fake pynvml: ``nvml(**kwargs)`` returns it, in sys.modules for the test."""
    def install(**kwargs):
        m = fake_pynvml(**kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", m)
        return m
    return install


@pytest.fixture
def no_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError


def test_the_slowdown_bits_are_pynvmls():
    pynvml = pytest.importorskip("pynvml")
    for reason, bit in {"SwPowerCap": 0x4, "HwSlowdown": 0x8, "SwThermalSlowdown": 0x20, "HwThermalSlowdown": 0x40,
                        "HwPowerBrakeSlowdown": 0x80}.items():
        assert getattr(pynvml, f"nvmlClocksThrottleReason{reason}") == bit
        assert getattr(pynvml, f"nvmlClocksEventReason{reason}", bit) == bit
    assert set(telemetry.SLOWDOWN) == {0x4, 0x8, 0x20, 0x40, 0x80}
    assert set(telemetry.SLOWDOWN.values()) == {"sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"}
    for benign in ("GpuIdle", "ApplicationsClocksSetting", "SyncBoost", "DisplayClockSetting"):
        assert getattr(pynvml, f"nvmlClocksThrottleReason{benign}") not in telemetry.SLOWDOWN
        assert telemetry.REASONS[getattr(pynvml, f"nvmlClocksThrottleReason{benign}")]


def test_a_gpu_is_found_by_uuid_and_read(nvml):
    m = nvml()
    gpu = Gpu.by_uuid(UUID)
    assert gpu.uuid == UUID and gpu.name == "NVIDIA H200"
    assert Gpu.by_uuid(UUID.removeprefix("GPU-")).uuid == UUID  # torch's bare form gets the prefix
    assert gpu.snapshot() == Snapshot(sm_mhz=1980, mem_mhz=2619, temp_c=41, power_w=123.456, throttle=0x1)
    assert gpu.free_bytes() == 100 * 2**30 and telemetry.driver_version() == "550.54.15"
    assert Gpu.by_uuid("GPU-00000000-0000-0000-0000-000000000000") is None and Gpu.by_uuid("") is None
    assert m.calls["init"] == 1  # once per process, however many queries


def test_an_older_pynvml_answers_bytes_and_throttle_reasons(nvml):
    nvml(old=True)
    gpu = Gpu.by_uuid(UUID)
    assert gpu.name == "NVIDIA H200" and telemetry.driver_version() == "550.54.15"
    assert gpu.snapshot().throttle == 0x1


def test_unsupported_queries_are_none(nvml):
    nvml(unsupported=("power", "reasons", "temp"))
    snap = Gpu.by_uuid(UUID).snapshot()
    assert snap == Snapshot(sm_mhz=1980, mem_mhz=2619, temp_c=None, power_w=None, throttle=None)
    nvml(unsupported=("clock",))
    snap = Gpu.by_uuid(UUID).snapshot()
    assert snap.sm_mhz is None and snap.mem_mhz is None and snap.temp_c == 41


def test_without_nvml_everything_is_none(no_nvml, nvml):
    assert Gpu.by_uuid(UUID) is None and telemetry.driver_version() is None
    m = nvml(init_error=True)  # the package, but no driver
    assert Gpu.by_uuid(UUID) is None and telemetry.driver_version() is None
    Gpu.by_uuid(UUID)
    assert m.calls["init"] == 1  # a failed init is not retried for every query


def test_reason_names():
    assert telemetry.reason_names(None) == [] and telemetry.reason_names(0) == []
    assert telemetry.reason_names(0x1 | 0x20 | 0x4) == ["gpu_idle", "sw_power_cap", "sw_thermal"]
    assert telemetry.reason_names(0x2 | 0x10 | 0x100 | 0x80 | 0x40 | 0x8) == [
        "applications_clocks_setting", "hw_slowdown", "sync_boost", "hw_thermal", "hw_power_brake", "display_clocks"]
    assert telemetry.reason_names(1 << 20) == ["0x100000"]  # a bit newer than this module still shows


def snap(sm=1980, throttle=0x0, **kw):
    return Snapshot(sm_mhz=sm, mem_mhz=kw.get("mem", 2619), temp_c=kw.get("temp", 40), power_w=kw.get("power", 300.0),
                    throttle=throttle)


def test_point_columns_of_a_clean_point(nvml):
    nvml()
    gpu = Gpu.by_uuid(UUID)
    cols = point_columns(gpu, snap(throttle=0x1), snap(1965, throttle=0x0, temp=45, power=450.5))
    assert cols == {"gpu_uuid": UUID, "sm_mhz_start": 1980, "sm_mhz_end": 1965, "mem_mhz_start": 2619,
                    "mem_mhz_end": 2619, "temp_c_start": 40, "temp_c_end": 45, "power_w_start": 300.0,
                    "power_w_end": 450.5, "throttle_reasons": "gpu_idle", "throttled": False, "clock_drop": False}
    assert suspect(cols) is None
    assert point_columns(gpu, snap(), snap())["throttle_reasons"] == ""  # known, and none


def test_point_columns_of_a_throttled_point():
    cols = point_columns(None, snap(throttle=0x1), snap(1755, throttle=0x20 | 0x10))
    assert cols["throttle_reasons"] == "gpu_idle,sync_boost,sw_thermal"  # start | end, every bit named
    assert cols["throttled"] is True and cols["clock_drop"] is True and cols["gpu_uuid"] is None
    assert suspect(cols) == "throttled: sw_thermal; SM clock 1980→1755 MHz"
    assert suspect(point_columns(None, snap(throttle=0x4), snap(throttle=0x8))) == "throttled: sw_power_cap, hw_slowdown"
    benign = point_columns(None, snap(throttle=0x2 | 0x10 | 0x100), snap(throttle=0x1))
    assert benign["throttled"] is False and suspect(benign) is None


def test_the_clock_drop_threshold():
    edge = round(1980 * (1 - telemetry.CLOCK_DROP))  # 1881: exactly 5 % below
    assert point_columns(None, snap(1980), snap(edge))["clock_drop"] is False
    assert point_columns(None, snap(1980), snap(edge - 1))["clock_drop"] is True
    assert point_columns(None, snap(1755), snap(1980))["clock_drop"] is False  # a rise flags nothing
    assert suspect(point_columns(None, snap(1980), snap(edge - 1))) == f"SM clock 1980→{edge - 1} MHz"


def test_unknown_telemetry_is_none_and_not_suspect():
    cols = point_columns(None, None, None)
    assert set(cols) == {"gpu_uuid", "sm_mhz_start", "sm_mhz_end", "mem_mhz_start", "mem_mhz_end", "temp_c_start",
                         "temp_c_end", "power_w_start", "power_w_end", "throttle_reasons", "throttled", "clock_drop"}
    assert all(v is None for v in cols.values()) and suspect(cols) is None
    unsupported = Snapshot(None, None, None, None, None)
    assert all(v is None for k, v in point_columns(None, unsupported, unsupported).items())
    half = point_columns(None, snap(throttle=None), snap(sm=None, throttle=0x40))  # one mask known: used
    assert half["throttle_reasons"] == "hw_thermal" and half["throttled"] is True and half["clock_drop"] is None
    assert suspect({"throttled": float("nan"), "clock_drop": None}) is None  # as a row read back by pandas


def test_env_reads_the_first_visible_gpu_through_nvml(nvml, monkeypatch):
    """The sweep's own process reads the GPU the workers get through NVML, never through torch."""
    nvml()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: pytest.fail("torch asked"))
    assert env.driver_version() == "550.54.15" and env.free_gpu_bytes() == 100 * 2**30
    m = env.machine()
    assert m.cuda and m.gpu_name == "NVIDIA H200" and m.free_gpu_bytes == 100 * 2**30
    here = env.host("cuda")
    assert here.gpu_uuid == UUID and here.gpu_name == "NVIDIA H200" and here.torch == torch.__version__
    assert here.cuda == torch.version.cuda
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000000")  # a GPU NVML does not know: none visible
    assert env.free_gpu_bytes() is None and not env.machine().cuda


def test_host_reads_torchs_version_file_not_its_metadata(tmp_path, monkeypatch):
    """A torch whose distribution metadata drops the local tag (2.11.0 for 2.11.0+cu130) is still
    reported as torch.__version__ says, so a resumed GPU run's rows and this host agree."""
    (tmp_path / "version.py").write_text("from typing import Optional\n__version__ = '2.11.0+cu130'\n"
                                         "cuda: Optional[str] = '13.0'\n")
    monkeypatch.setattr(env.importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(submodule_search_locations=[str(tmp_path)]))
    monkeypatch.setattr(env.metadata, "version", lambda name: "2.11.0")
    assert env._torch_build() == ("2.11.0+cu130", "13.0")
    assert env.host("cpu").torch == "2.11.0+cu130" and env.host("cpu").cuda is None
    (tmp_path / "version.py").write_text("garbled(")
    assert env._torch_build() == ("2.11.0", None)


def test_env_without_nvml_is_none(no_nvml):
    assert env.driver_version() is None and env.free_gpu_bytes() is None
    m = env.machine()
    assert not m.cuda and m.gpu_name is None and m.free_gpu_bytes is None
    assert env.host("cuda").gpu_name is None


def test_a_worker_reads_its_gpu_through_torch(nvml, monkeypatch):
    nvml()
    props = types.SimpleNamespace(uuid=UUID.removeprefix("GPU-"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    assert env.gpu_uuid() == UUID

    def no_cuda(i):
        raise AssertionError("Torch not compiled with CUDA enabled")
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_cuda)
    assert env.gpu_uuid() is None


@pytest.mark.gpu
@requires_cuda
def test_the_real_gpu():
    gpu = Gpu.by_uuid(f"GPU-{torch.cuda.get_device_properties(0).uuid}")
    assert gpu is not None and gpu.name and telemetry.driver_version()
    s = gpu.snapshot()
    assert s.sm_mhz > 0 and s.mem_mhz > 0 and s.temp_c > 0 and s.throttle is not None
    assert s.power_w is None or 10 < s.power_w < 2000
    assert 0 < gpu.free_bytes() <= torch.cuda.get_device_properties(0).total_memory
    cols = point_columns(gpu, s, gpu.snapshot())
    assert cols["gpu_uuid"] == gpu.uuid and isinstance(cols["throttled"], bool)
    assert env.free_gpu_bytes() > 0 and env.driver_version() == telemetry.driver_version()
