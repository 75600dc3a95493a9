"""tinyclimate: a tiny lat x lon climate emulator, split over latitude bands.

One step is: a pointwise encoder, explicit diffusion (a 5-point Laplacian that needs one
halo row from each neighbouring band), a global area-weighted mean fed back to every grid
point, and a pointwise decoder added to the input.
"""

from tinyclimate.model import TinyClimate, area_weights
from tinyclimate.parallel import BUGS, exchange_rows, global_sum, latitude_band, pad_rows

__all__ = [
    "BUGS",
    "TinyClimate",
    "area_weights",
    "exchange_rows",
    "global_sum",
    "latitude_band",
    "pad_rows",
]
