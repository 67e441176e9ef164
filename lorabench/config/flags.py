"""Turning a flag's or a spec file's raw value into a checked value, or one ``UserError`` line
that names the flag. Shared by the sweep's and the tune's specifications."""

from dataclasses import dataclass

from lorabench.errors import UserError


@dataclass(frozen=True)
class Machine:
    """What a spec's automatic defaults and checks depend on: is there a GPU, which, and how
    much memory a worker may take (None: unknown, not checked)."""

    cuda: bool
    gpu_name: str | None = None
    free_gpu_bytes: int | None = None  # free memory of the GPU workers run on
    free_ram_bytes: int | None = None  # RAM available to a new process (MemAvailable)

    def free_bytes(self, device: str) -> tuple[int | None, str]:
        """The memory a worker on ``device`` may take, and what it is called."""
        if device == "cuda":
            return self.free_gpu_bytes, f"free GPU memory{f' ({self.gpu_name})' if self.gpu_name else ''}"
        return self.free_ram_bytes, "available RAM"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def split_list(text: str) -> list[str]:
    """Split on commas outside brackets: ``max,[1,2,4]`` -> ['max', '[1,2,4]']."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


def to_int(name: str, value, minimum: int, maximum: int | None = None) -> int:
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        v = int(str(value).strip())
    except ValueError:
        raise UserError(f"{flag(name)}: {value!r} is not an integer") from None
    if v < minimum:
        raise UserError(f"{flag(name)}: {v} must be at least {minimum}")
    if maximum is not None and v > maximum:
        raise UserError(f"{flag(name)}: {v} must be at most {maximum}")
    return v


def to_ints(name: str, value, minimum: int = 1) -> list[int]:
    """A list (or comma-separated text) of integers >= minimum."""
    items = value if isinstance(value, list) else split_list(str(value))
    if any(str(i).strip() == "" for i in items):
        raise UserError(f"{flag(name)}: empty entry in {value!r}")
    return [to_int(name, i, minimum) for i in items]


def to_strs(name: str, value) -> list[str]:
    """A list (or comma-separated text) of names; a nested TOML list becomes ``[a,b]``."""
    items = value if isinstance(value, list) else split_list(str(value))
    items = [str(i) if not isinstance(i, list) else "[" + ",".join(map(str, i)) + "]" for i in items]
    if any(not i.strip() for i in items):
        raise UserError(f"{flag(name)}: empty entry in {value!r}")
    return [i.strip() for i in items]


def to_positive(name: str, value) -> float:
    try:
        v = float(str(value).strip())
    except ValueError:
        v = -1.0
    if not 0 < v < float("inf"):
        raise UserError(f"{flag(name)}: {value!r} is not a positive number")
    return v


def to_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in ("true", "false"):
        return str(value).strip().lower() == "true"
    raise UserError(f"{flag(name)}: {value!r} is not true or false")


def one_of(name: str, value, known) -> None:
    if value not in known:
        raise UserError(f"{flag(name)}: {value!r} is not one of {', '.join(map(str, known))}")


def resolve_device(device: str, machine: Machine) -> str:
    """``auto`` -> ``cuda`` when the machine has a GPU, else ``cpu``; a wrong device is one line."""
    if device not in ("auto", "cuda", "cpu"):
        raise UserError(f"--device: {device!r} is not one of auto, cuda, cpu")
    if device == "cuda" and not machine.cuda:
        raise UserError("--device cuda: no CUDA device is visible to torch on this machine")
    return device if device != "auto" else ("cuda" if machine.cuda else "cpu")
