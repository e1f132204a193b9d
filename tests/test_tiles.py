"""bfloat16 weights on AMX tiles (specfree/kernels/tiles.py, tile_linear.cpp): the op against float64
over odd shapes and 1-64 rows; each row's bits independent of the other rows; the tiles' round trip;
a bfloat16 model packed onto tiles computes what its panels do within bfloat16 rounding, keeps one
copy of each weight (a tied embedding reads the head's tiles) and gives the stock state dict back.
Skipped where the CPU has no AMX (or the OS does not let the process use it)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from specfree.kernels import has_amx, library_linears, linear_path, load_kernels, prepare_linears
from specfree.kernels.panels import PanelEmbedding
from specfree.kernels.tiles import TileEmbedding, TileLinear, pack_tiles, unpack_tiles
from tests.tiny_models import tiny_model

fresh_model = tiny_model.__wrapped__

pytestmark = pytest.mark.skipif(load_kernels(progress=False) is None or not has_amx(),
                                reason="needs a CPU with AMX (Intel Xeon Sapphire Rapids or later) the OS "
                                       "lets this process use (or the kernels cannot be built)")


def tile_linear(x, weight, bias):
    return torch.ops.specfree.tile_linear(x, pack_tiles(weight), bias, weight.shape[0])


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 64), k=st.integers(1, 200), n=st.integers(1, 100), with_bias=st.booleans(),
       seed=st.integers(0, 99))
def test_the_op_equals_matmul_in_float64_and_each_row_keeps_its_bits(rows, k, n, with_bias, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    weight = torch.randn(n, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16() if with_bias else None
    out = tile_linear(x, weight, bias)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    # accumulated in float32, then rounded once to bfloat16 (relative 2**-8)
    tolerance = 1e-5 * k ** 0.5 * (x.double().abs().max() * weight.double().abs().max() + 1) + expected.abs() / 256
    assert ((out.double() - expected).abs() <= tolerance).all()
    for row in {0, rows // 2, rows - 1}:
        assert torch.equal(tile_linear(x[row:row + 1], weight, bias)[0], out[row])


def test_pack_and_unpack_round_trip_and_the_op_refuses_what_it_cannot_run():
    weight = torch.randn(19, 45).bfloat16()
    tiles = pack_tiles(weight)
    assert tiles.shape == (2, 2, 16, 32) and torch.equal(unpack_tiles(tiles, 19, 45), weight)
    with pytest.raises(RuntimeError, match="bfloat16 activations"):
        torch.ops.specfree.tile_linear(torch.randn(2, 45), tiles, None, 19)
    with pytest.raises(RuntimeError, match="do not multiply"):
        torch.ops.specfree.tile_linear(torch.randn(2, 12).bfloat16(), tiles, None, 19)


def bf16_llama():
    model = fresh_model("llama").to(torch.bfloat16)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.get_input_embeddings().weight  # tied, as SmolLM2
    return model


def test_a_bfloat16_model_runs_on_tiles_close_to_its_panels_and_keeps_one_copy():
    model = bf16_llama()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    stock_state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        stock = model(ids).logits.float()
    assert prepare_linears(model) > 0
    assert linear_path(model).startswith("few_row-tiles-")
    heads = [m for m in model.modules() if isinstance(m, TileLinear)]
    assert heads and isinstance(model.get_input_embeddings(), TileEmbedding)
    assert model.get_input_embeddings().panels is model.lm_head.panels  # the tie stays one tensor
    with torch.no_grad():
        tiled = model(ids).logits.float()
        # the embedding reads the head's rows exactly
        assert torch.equal(model.get_input_embeddings()(ids), stock_state["model.embed_tokens.weight"][ids])
        # one row alone has the same bits as in the whole prompt
        assert torch.equal(model(ids[:, :1]).logits[0, 0], model(ids).logits[0, 0])
    torch.testing.assert_close(tiled, stock, rtol=0.05, atol=0.05)  # bfloat16: another order of roundings
    state = model.state_dict()
    assert state.keys() == stock_state.keys()
    assert all(torch.equal(state[k], stock_state[k]) for k in state)
    assert library_linears(model) > 0 and not any(isinstance(m, (TileLinear, PanelEmbedding))
                                                   for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits.float(), stock)


def test_activations_in_another_dtype_are_never_rounded_to_bfloat16():
    layer = nn.Linear(40, 24).bfloat16()
    tiled = TileLinear(layer)
    x = torch.randn(3, 40)
    torch.testing.assert_close(tiled(x), torch.nn.functional.linear(x, layer.weight.float(), layer.bias.float()))
