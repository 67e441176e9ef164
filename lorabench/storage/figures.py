"""Figures written as PNG in 256 colours: a plot's lines, markers and text need no more, and the
file is about a third of matplotlib's full-colour one (results are kept in git)."""

import io
from pathlib import Path

from PIL import Image

DPI = 110


def save_png(fig, path: Path) -> Path:
    """``fig`` (a matplotlib figure) into ``path``, palettised; the figure is left open. It is
    drawn to raw RGBA pixels, the same pixels a full-colour PNG holds, without writing one and
    reading it back."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="rgba", dpi=DPI)
    size = tuple(int(x * DPI) for x in fig.get_size_inches())  # as Agg sizes its canvas
    image = Image.frombuffer("RGBA", size, buffer.getbuffer(), "raw", "RGBA", 0, 1)
    image.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(path, format="PNG", optimize=True)
    return Path(path)
