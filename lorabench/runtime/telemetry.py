"""GPU telemetry through NVML (``pynvml``, from the nvidia-ml-py package): clocks, temperature,
power and the clock-event (throttle) reasons at the start and end of every measured point, so a
point timed on a GPU that slowed itself can be flagged; plus the driver version and free memory,
read without a CUDA context (``torch.cuda.mem_get_info`` would hold one, 0.5 GiB, in the sweep's
own process) and without an ``nvidia-smi`` subprocess per query.

Read-only: nothing here locks or changes clocks. Without pynvml or without a driver (a CPU
machine) every query answers None and nothing raises. pynvml is imported lazily and only it and
the standard library are imported here, so importing this module is cheap."""

import os
import threading
from dataclasses import dataclass

# NVML's clocks-event reason bits (nvml.h's nvmlClocksEventReason* / the older
# nvmlClocksThrottleReason*, same values), written out so that this module need not import pynvml
# to name them; tests/test_telemetry.py checks them against pynvml's constants.
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",  # also nvmlClocksEventReasonUserDefinedClocks
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
    0x200: "board_limit",  # only in pynvml's older Throttle list
    0x400: "reliability",  # likewise
}
# The reasons that mean the GPU slowed itself (power, heat, an external brake): a point timed under
# one of them measured the GPU's state, not the kernels. Idle, application clocks, sync boost and
# display clocks are ordinary states of a working GPU and flag nothing.
SLOWDOWN = {bit: REASONS[bit] for bit in (0x4, 0x8, 0x20, 0x40, 0x80)}
CLOCK_DROP = 0.05  # an SM clock at the end of a point more than 5 % below the start flags it

_lock = threading.Lock()
_ready: tuple[int, object, bool] | None = None  # (pid, pynvml module, nvmlInit succeeded)


def _nvml():
    """pynvml, initialised once per process (again in a forked child, whose parent's NVML state
    it must not reuse); None without the package or without a driver."""
    global _ready
    try:
        import pynvml
    except ImportError:
        return None
    with _lock:
        if _ready is None or _ready[0] != os.getpid() or _ready[1] is not pynvml:
            try:
                pynvml.nvmlInit()
                ok = True
            except (pynvml.NVMLError, OSError):
                ok = False
            _ready = (os.getpid(), pynvml, ok)
        return pynvml if _ready[2] else None


def _text(value) -> str:
    """pynvml answers str in recent releases, bytes in older ones."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def driver_version() -> str | None:
    """The driver's version ("550.54.15"), system-wide: no GPU handle needed."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        return _text(nvml.nvmlSystemGetDriverVersion()) or None
    except nvml.NVMLError:
        return None


@dataclass(frozen=True)
class Snapshot:
    """A GPU's state at one instant; a field is None where the GPU does not support its query."""
    sm_mhz: int | None
    mem_mhz: int | None
    temp_c: int | None
    power_w: float | None
    throttle: int | None  # clocks-event reasons bitmask (REASONS)


class Gpu:
    """One GPU, read through NVML by UUID: NVML numbers GPUs regardless of CUDA_VISIBLE_DEVICES,
    a UUID names the one torch's device means."""

    def __init__(self, nvml, handle, uuid: str, name: str):
        self._nvml, self._handle, self.uuid, self.name = nvml, handle, uuid, name

    def __repr__(self) -> str:
        return f"Gpu({self.uuid!r}, {self.name!r})"

    @classmethod
    def by_uuid(cls, uuid: str) -> "Gpu | None":
        """The GPU of ``uuid`` ("GPU-xxxxxxxx-...", as ``f"GPU-{torch.cuda.get_device_properties(i).uuid}"``
        gives; the bare form gets the prefix); None without NVML or without that GPU."""
        nvml = _nvml()
        if nvml is None or not uuid:
            return None
        uuid = str(uuid)
        if not uuid.startswith(("GPU-", "MIG-")):
            uuid = f"GPU-{uuid}"
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        except nvml.NVMLError:
            return None
        try:
            name = _text(nvml.nvmlDeviceGetName(handle))
        except nvml.NVMLError:
            name = ""
        return cls(nvml, handle, uuid, name)

    def _read(self, query: str, *args):
        """One NVML query on this GPU; None when unsupported or failing (or absent from this pynvml)."""
        fn = getattr(self._nvml, query, None)
        if fn is None:
            return None
        try:
            return fn(self._handle, *args)
        except self._nvml.NVMLError:
            return None

    def _throttle(self) -> int | None:
        # Renamed in driver 535 / nvidia-ml-py 12.535 (throttle -> clocks event); the older name
        # stays for older drivers and pynvml releases.
        for query in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            mask = self._read(query)
            if mask is not None:
                return int(mask)
        return None

    def snapshot(self) -> Snapshot:
        """Clocks, temperature, power and clock-event reasons now; each None when unsupported."""
        nvml = self._nvml
        sm = self._read("nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_SM)
        mem = self._read("nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_MEM)
        temp = self._read("nvmlDeviceGetTemperature", nvml.NVML_TEMPERATURE_GPU)
        milliwatts = self._read("nvmlDeviceGetPowerUsage")
        return Snapshot(sm_mhz=None if sm is None else int(sm), mem_mhz=None if mem is None else int(mem),
                        temp_c=None if temp is None else int(temp),
                        power_w=None if milliwatts is None else milliwatts / 1000, throttle=self._throttle())

    def free_bytes(self) -> int | None:
        """Free device memory in bytes, as nvidia-smi's memory.free; None when unreadable."""
        info = self._read("nvmlDeviceGetMemoryInfo")
        return None if info is None else int(info.free)


def reason_names(mask: int | None) -> list[str]:
    """Every bit set in ``mask`` as a name (benign ones too; an unnamed bit as its hex value),
    lowest bit first; [] for None or 0."""
    if not mask:
        return []
    mask = int(mask)
    return [REASONS.get(1 << i, hex(1 << i)) for i in range(mask.bit_length()) if mask >> i & 1]


def point_columns(gpu: Gpu | None, start: Snapshot | None, end: Snapshot | None) -> dict:
    """The telemetry columns of one point's row, from the snapshots taken before and after it is
    timed; a value None where unknown (no GPU, no NVML, an unsupported query)."""
    def field(snap, name):
        return None if snap is None else getattr(snap, name)

    cols = {"gpu_uuid": None if gpu is None else gpu.uuid}
    for name in ("sm_mhz", "mem_mhz", "temp_c", "power_w"):
        cols[f"{name}_start"], cols[f"{name}_end"] = field(start, name), field(end, name)
    masks = [m for m in (field(start, "throttle"), field(end, "throttle")) if m is not None]
    mask = None
    if masks:
        mask = 0
        for m in masks:
            mask |= m
    cols["throttle_reasons"] = None if mask is None else ",".join(reason_names(mask))
    cols["throttled"] = None if mask is None else any(mask & bit for bit in SLOWDOWN)
    sm0, sm1 = cols["sm_mhz_start"], cols["sm_mhz_end"]
    cols["clock_drop"] = None if sm0 is None or sm1 is None or sm0 <= 0 else bool(sm1 < (1 - CLOCK_DROP) * sm0)
    return cols


def _true(value) -> bool:
    """A flag column's value as read back (None, NaN or pandas' NA mean unknown, not set)."""
    if value is None or (isinstance(value, float) and value != value):
        return False
    try:
        return bool(value)
    except (TypeError, ValueError):
        return False


def suspect(columns: dict) -> str | None:
    """Why the point's timing is suspect ("throttled: sw_thermal", "SM clock 1980→1755 MHz"), or
    None when clean or unknown: the sweep ORs it into the point's noisy flag."""
    why = []
    if _true(columns.get("throttled")):
        names = [n for n in str(columns.get("throttle_reasons") or "").split(",") if n in SLOWDOWN.values()]
        why.append(f"throttled: {', '.join(names)}" if names else "throttled")
    if _true(columns.get("clock_drop")):
        why.append(f"SM clock {columns.get('sm_mhz_start')}→{columns.get('sm_mhz_end')} MHz")
    return "; ".join(why) or None
