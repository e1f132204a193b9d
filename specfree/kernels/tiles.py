"""bfloat16 weights packed once, in place, into AMX tiles (``tile_linear.cpp``).

On a CPU with AMX a bfloat16 model's products run ``specfree::tile_linear``: 1-16 rows cost one
read of the weights (the widened AVX-512 panels pay each extra row's FMAs). The weight lives only as
tiles ``[N/16, Kp/32, 16, 32]``: per 16 output columns and 32 inputs, 16 rows of input pairs
(k, k+1) for each column, Kp = K rounded up to 32, padding zeros. ``TileLinear`` is a
``PanelLinear`` over that storage: ``.weight``, the state dict (stock keys and layout),
``to_linear()`` and a tied embedding (``TileEmbedding``, its rows read from the head's tiles) work
as they do for panels. Activations in another dtype than bfloat16 (a mixed-precision caller) take
``F.linear`` over an unpacked copy: slower, never rounded to bfloat16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specfree.kernels.hugepages import HugePageArena
from specfree.kernels.panels import PanelEmbedding, PanelLinear

COLUMNS, BLOCK = 16, 32  # output columns per panel, inputs per tile


def pack_tiles(weight: torch.Tensor, arena: HugePageArena | None = None) -> torch.Tensor:
    """[N, K] -> tiles [ceil(N / 16), ceil(K / 32), 16, 32], zeros past N and K; in ``arena``'s memory if given."""
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, (-k) % BLOCK, 0, (-n) % COLUMNS))
    panels, blocks = padded.shape[0] // COLUMNS, padded.shape[1] // BLOCK
    # [panel, column, block, pair, 2] -> [panel, block, pair, column, 2]
    tiles = padded.reshape(panels, COLUMNS, blocks, BLOCK // 2, 2).permute(0, 2, 3, 1, 4)
    tiles = tiles.reshape(panels, blocks, BLOCK // 2, COLUMNS * 2)
    return tiles.contiguous() if arena is None else arena.empty(tiles.shape, weight.dtype).copy_(tiles)


def tile_bytes(module: nn.Module) -> int:
    """The bytes ``TileLinear`` packs this layer's weight into."""
    n, k = module.weight.shape
    return -(-n // COLUMNS) * COLUMNS * -(-k // BLOCK) * BLOCK * module.weight.element_size()


def unpack_tiles(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Tiles -> a new [N, K] tensor (the inverse of ``pack_tiles``)."""
    panels, blocks = tiles.shape[:2]
    rows = tiles.reshape(panels, blocks, BLOCK // 2, COLUMNS, 2).permute(0, 3, 1, 2, 4)
    return rows.reshape(panels * COLUMNS, blocks * BLOCK)[:n, :k].contiguous()


def tiles_fit(module: nn.Module) -> bool:
    """A plain bfloat16 ``nn.Linear`` on the CPU (GPT-2's ``Conv1D`` keeps its panels)."""
    return type(module) is nn.Linear and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu"


class TileLinear(PanelLinear):
    """A bfloat16 ``nn.Linear`` whose weight lives only as AMX tiles (held as ``panels``, so
    everything that handles a ``PanelLinear``'s storage handles these); its product runs
    ``specfree::tile_linear``."""

    def __init__(self, linear: nn.Module, arena: HugePageArena | None = None):
        nn.Module.__init__(self)
        self.out_features, self.in_features = linear.weight.shape
        self.panels = nn.Parameter(pack_tiles(linear.weight, arena), requires_grad=False)
        self.register_parameter("bias", linear.bias)

    def rows(self) -> torch.Tensor:
        """The weight as [N, K], a new tensor each call (the tiles are the storage)."""
        return unpack_tiles(self.panels, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._parameters
        if x.dtype != torch.bfloat16:  # never round a caller's activations to bfloat16
            bias = params["bias"]
            return F.linear(x, self.weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return torch.ops.specfree.tile_linear(x, params["panels"], params["bias"], self.out_features)

    def tied_embedding(self, embedding: nn.Embedding) -> nn.Module:
        return TileEmbedding(embedding, self)

    def _load_weight(self, weight: torch.Tensor, prefix: str, error_msgs: list[str]) -> bool:
        with torch.no_grad():
            self.panels.copy_(pack_tiles(weight.to(self.panels.dtype)))
        return True

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tiles={tuple(self.panels.shape)}")


class TileEmbedding(PanelEmbedding):
    """A plain ``nn.Embedding`` tied to a ``TileLinear`` head: rows read from the head's tiles."""

    @property
    def weight(self) -> torch.Tensor:
        return unpack_tiles(self.panels, self.num_embeddings, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., K]
        rows = self.panels[torch.div(ids, COLUMNS, rounding_mode="floor")]  # [..., blocks, pairs, 32]
        rows = rows.unflatten(-1, (COLUMNS, 2))  # [..., blocks, pairs, column, 2]
        column = (ids % COLUMNS)[..., None, None, None, None].expand(*rows.shape[:-2], 1, 2)
        return rows.gather(-2, column).reshape(*ids.shape, -1)[..., : self.embedding_dim]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tied to a TileLinear head's tiles"
