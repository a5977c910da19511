"""The layers x positions picture of a kept map: a small PNG, written with the standard library (zlib), no plotting
package, so `h2o-kv inspect` needs only the core install.

Positions are averaged into at most `MAX_WIDTH` columns (a 32k-token prompt stays a picture of a few KB); each layer
is one row of pixels, stretched by the page. The colours are the page's: white for a position no head of the layer
keeps, dark green for one every head keeps (ColorBrewer's Greens).
"""

from __future__ import annotations

import base64
import math
import struct
import zlib

import torch

from h2o_kv.cache.kept import binned

MAX_WIDTH = 1200  # pixel columns: positions past this are averaged in bins
# ColorBrewer Greens, from "none kept" to "all kept"
GREENS = ((247, 252, 245), (199, 233, 192), (116, 196, 118), (35, 139, 69), (0, 68, 27))


def palette(steps: int = 256) -> torch.Tensor:
    """`steps` RGB colours [steps, 3] uint8, from GREENS' first to its last, linearly between its anchors."""
    anchors = torch.tensor(GREENS, dtype=torch.float32)
    where = torch.linspace(0, len(GREENS) - 1, steps)
    low = where.floor().long().clamp(max=len(GREENS) - 2)
    t = (where - low).unsqueeze(1)
    return (anchors[low] * (1 - t) + anchors[low + 1] * t).round().to(torch.uint8)


def colour(fraction: float) -> str:
    """The CSS colour of a kept fraction in [0, 1], as the picture draws it."""
    r, g, b = palette()[round(min(max(fraction, 0.0), 1.0) * 255)].tolist()
    return f"#{r:02x}{g:02x}{b:02x}"


def columns(positions: int, max_width: int = MAX_WIDTH) -> int:
    """Positions per pixel column."""
    return max(1, math.ceil(positions / max_width))


def picture(layer_fraction: torch.Tensor, max_width: int = MAX_WIDTH) -> bytes:
    """A PNG of `layer_fraction` [layers, positions] (values in [0, 1]): one pixel row per layer, positions averaged
    into at most `max_width` columns."""
    values = binned(layer_fraction.float().cpu(), columns(layer_fraction.shape[-1], max_width))
    index = (values.clamp(0, 1) * 255).round().long()
    pixels = palette()[index]  # [layers, width, 3]
    return png(pixels)


def png(pixels: torch.Tensor) -> bytes:
    """An 8-bit RGB PNG of `pixels` [height, width, 3] uint8."""
    height, width, _ = pixels.shape
    rows = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), pixels.reshape(height, width * 3)], dim=1)  # filter 0

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = zlib.compress(rows.numpy().tobytes(), 6)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode("ascii")
