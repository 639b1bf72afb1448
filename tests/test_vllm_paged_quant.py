"""kvstack's quantized tier in vLLM's pages, in kvstack's own environment (no vLLM): the page layout holds exactly
the tier's tensors, its size is kvstack's memory formula, and one request's steps attend as the stage's tiers do.
The engine itself (against kvstack's transformers cache) is tested in tests/vllm_engine/."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack import SpecError
from kvstack.integrations.vllm.paged_quant import PagedQuantLayout, Residual, request_attention
from kvstack.kernels.quant_pack import dequantize
from kvstack.stack.shape import ModelShape
from kvstack.stages.quantize import QuantizeSpec, quantized_slot_bytes
from transformers import LlamaConfig


def _shape(dtype=torch.float32, head_dim=64, kv_heads=2):
    config = LlamaConfig(hidden_size=head_dim * 2 * kv_heads, num_attention_heads=2 * kv_heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=2, vocab_size=64)
    return ModelShape.from_config(config, dtype)


def _spec(**fields):
    return QuantizeSpec(**{"bits": 4, "group_size": 32, "value_group_size": "head_dim", "residual": 32, **fields})


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    group=st.sampled_from([8, 16, 32]),
    blocks_per_group=st.sampled_from([1, 2, 4]),
    value_group=st.sampled_from([8, 32, "head_dim"]),
    scale=st.sampled_from(["model", "float16", "float8_e4m3fn"]),
    options=st.sampled_from([{}, {"rotate": "hadamard", "key_rope": "pre", "codebook": "nf"}]),
    groups=st.integers(1, 9),
    data=st.data(),
)
def test_pages_hold_exactly_the_tiers_tensors(bits, group, blocks_per_group, value_group, scale, options, groups,
                                              data):
    """Tokens quantized by the stage's tier, written into shuffled blocks a few groups at a time, read back: every
    code, scale and zero point is the tier's, and a page is the bytes kvstack's memory formula gives the tier."""
    if bits == 8:
        options = {k: v for k, v in options.items() if k != "codebook"}
    spec = _spec(bits=bits, group_size=group, value_group_size=value_group, scale_dtype=scale, **options)
    shape, heads, block = _shape(), 2, group * blocks_per_group
    layout = PagedQuantLayout(spec, shape, heads, block)
    vg = shape.value_dim if value_group == "head_dim" else value_group
    slot_bytes = quantized_slot_bytes(shape, shape.dtype, bits, group, vg, 0, scale_dtype=spec.scale_torch_dtype())
    assert layout.region_bytes * heads == slot_bytes(block)  # no position or record: vLLM's positions are implicit
    assert layout.cell_bytes == math.ceil(layout.region_bytes / block)

    n = groups * group
    torch.manual_seed(groups)
    keys, values = torch.randn(1, heads, n, 64) * 3, torch.randn(1, heads, n, 64)
    positions = torch.arange(n, dtype=torch.int32)[None, None]
    codec = layout.codec(0)
    whole = layout.new_tier(codec, 0)
    whole.append(keys, values, positions)

    n_blocks = -(-n // block)
    pages = torch.zeros(n_blocks + 3, heads, block, layout.cell_bytes, dtype=torch.uint8)
    block_ids = torch.randperm(n_blocks + 3)[:n_blocks]
    cuts = sorted(set(data.draw(st.lists(st.integers(1, groups - 1), max_size=3)) if groups > 1 else []))
    for a, b in zip([0, *cuts], [*cuts, groups]):
        piece = layout.new_tier(codec, 0)
        piece.append(keys[:, :, a * group : b * group], values[:, :, a * group : b * group],
                     positions[..., a * group : b * group])
        layout.write(pages, block_ids, piece, a * group)
    back = layout.read(pages, block_ids, n, codec, 0)
    for name in ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero"):
        mine, theirs = getattr(back, name), getattr(whole, name)
        assert mine.dtype == theirs.dtype and torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), name
    assert torch.equal(back.positions, whole.positions)


def test_the_page_sizes_of_the_presets_on_a_bf16_llama():
    """SmolLM2's shape (head_dim 64, bf16): KIVI-4 pages are 76 of 256 bytes per token and KV head, KIVI-3's
    (fp8 scales, key groups of 16) 58."""
    shape = _shape(torch.bfloat16, kv_heads=3)
    kivi4 = PagedQuantLayout(_spec(), shape, 3, 32)
    kivi3 = PagedQuantLayout(_spec(bits=3, group_size=16, scale_dtype="float8_e4m3fn"), shape, 3, 32)
    assert (kivi4.cell_bytes, kivi4.full_cell_bytes, kivi3.cell_bytes) == (76, 256, 58)
    assert kivi4.page_ratio == pytest.approx(76 / 256)


def test_a_block_must_hold_whole_key_groups():
    with pytest.raises(SpecError, match="block_size=48 is not allowed with stages.0.group_size=32"):
        PagedQuantLayout(_spec(), _shape(), 2, 48)


def _reference(query, keys, values, quantized: int, layout, codec, scaling):
    """Causal attention of the last len(query) tokens over the first ``quantized`` tokens as the stage's tier
    dequantizes them and the rest in full precision ([T, H, D] inputs)."""
    k, v = keys.clone(), values.clone()
    if quantized:
        tier = layout.new_tier(codec, 0)
        pos = torch.arange(quantized, dtype=torch.int32)[None, None]
        tier.append(keys[:quantized].transpose(0, 1)[None], values[:quantized].transpose(0, 1)[None], pos)
        k_hat = codec.keys(dequantize(tier.key_groups()), pos)[0].transpose(0, 1)
        v_hat = codec.values(dequantize(tier.value_groups()))[0].transpose(0, 1)
        k[:quantized], v[:quantized] = k_hat, v_hat
    n, t = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", query, k) * scaling
    visible = torch.arange(t)[None, :] <= torch.arange(t - n, t)[:, None]
    weights = logits.masked_fill(~visible, -math.inf).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("options", [{}, {"rotate": "hadamard", "key_rope": "pre", "bits": 3, "group_size": 16}])
def test_a_requests_steps_attend_over_its_pages_and_residual(options):
    """A prompt in two chunks, then decode steps, through request_attention and one pool: each step's output is
    attention over the stage's dequantized tokens plus the full-precision rest, and the pages fill a
    group at a time beyond the residual."""
    torch.manual_seed(0)
    shape, heads = _shape(torch.float32), 2
    layout = PagedQuantLayout(_spec(**options), shape, heads, 32)
    codec = layout.codec(0)
    total = 150
    keys, values = torch.randn(total, heads, 64), torch.randn(total, heads, 64)
    queries = torch.randn(total, 2 * heads, 64)
    pages = torch.zeros(8, heads, 32, layout.cell_bytes, dtype=torch.uint8)
    block_ids = torch.tensor([5, 2, 7, 0, 3])
    store, seen = Residual(), 0
    for n in (70, 40, *[1] * 40):
        before = layout.quantized_count(seen)
        held = store.get("r", 0, before, seen, keys[seen : seen + n], values[seen : seen + n])
        out, (start, k, v) = request_attention(layout, codec, 0, queries[seen : seen + n], keys[seen : seen + n],
                                               values[seen : seen + n], pages, block_ids, seen, held, scaling=0.125,
                                               softcap=None)
        want = _reference(queries[seen : seen + n], keys[: seen + n], values[: seen + n], before, layout, codec, 0.125)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
        seen += n
        assert start == layout.quantized_count(seen) and k.shape[1] == seen - start
        assert layout.spec.residual <= seen - start < layout.spec.residual + layout.group
        store.put("r", 0, start, k, v)
    assert store.nbytes() == (seen - start) * heads * 64 * 2 * 4
    with pytest.raises(RuntimeError, match="the residual holds tokens"):
        store.get("r", 0, 0, 77, keys[:1], values[:1])
    store.drop(["r"])
    assert store.nbytes() == 0
