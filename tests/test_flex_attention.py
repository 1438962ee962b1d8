"""ops/flex_attention.py: kernel options from the shape, every block size, one compile.

* ``cuda_kernel_options``: tiles divide the BlockMask's block and are powers
  of two >= 16, fit the device's shared memory, TMA only where the device and
  the rows allow it; the H200-tuned set only where all of it fits.
* ``block_mask`` for a block size no CUDA tile divides: a coarse grid whose
  ``mask_mod`` keeps exactly the selection (checked through compiled
  FlexAttention, on each device, against dense attention under the token mask).
* ``flex_attention_forward`` compiles once for many sequence lengths and never
  runs FlexAttention eagerly (which would build the whole score matrix).

The tests that build masks or run FlexAttention take the ``device`` fixture;
their float64 references stay on the CPU.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from stem_indexer import StemIndexerInputError
from stem_indexer.operator.ops import flex_attention as flex
from stem_indexer.testing import reference_attention, token_mask

pytestmark = pytest.mark.skipif(not flex.available(), reason="no FlexAttention in this torch")

H200 = (9, 0)
A100 = (8, 0)
RTX4090 = (8, 9)
B200 = (10, 0)
BLOCK_SIZES = [16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512, 1024]
HEAD_DIMS = [16, 32, 64, 80, 96, 128, 192, 256, 512]


def _smem_limit(capability) -> int:
    return {A100: 163 * 1024, H200: 227 * 1024, B200: 227 * 1024}.get(capability, 99 * 1024)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("capability", [A100, RTX4090, H200, B200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_options_divide_the_block_and_fit_shared_memory(capability, dtype):
    itemsize = torch.empty((), dtype=dtype).element_size()
    for bs in BLOCK_SIZES:
        grid = flex.choose_mask_block_size(bs, "cuda")
        for d in HEAD_DIMS:
            opts = flex.cuda_kernel_options(grid, grid, d, d, dtype, capability)
            bm, bn = opts["BLOCK_M"], opts["BLOCK_N"]
            where = (bs, d, dtype, capability, opts)
            # Tiles FlexAttention accepts: powers of two, >= 16, dividing the block.
            for tile in (bm, bn):
                assert tile >= 16 and tile & (tile - 1) == 0 and grid % tile == 0, where
            # Q tile plus num_stages K and V tiles (head dims rounded up to
            # powers of two, as the kernel pads them) fit shared memory.
            smem = itemsize * (bm * _pow2(d) + opts["num_stages"] * bn * 2 * _pow2(d))
            assert smem <= _smem_limit(capability) or (bm, bn, opts["num_stages"]) == \
                (16, 16, 1), where
            assert opts["num_stages"] >= 1 and opts["num_warps"] in (4, 8), where
            # TMA: sm_90 and newer, 16-bit rows of 16-byte multiples, head dim <= 256.
            assert opts["USE_TMA"] == (capability >= H200 and itemsize == 2 and d <= 256
                                       and d * itemsize % 16 == 0), where


def test_the_h200_tuned_set_only_where_it_fits():
    tuned = flex.CUDA_KERNEL_OPTIONS
    assert flex.cuda_kernel_options(128, 128, 128, 128, torch.bfloat16, H200) == tuned
    assert flex.cuda_kernel_options(256, 256, 64, 64, torch.float16, H200) == tuned
    # A 32-token Stem block (the README's and the tests'): 128-wide tiles
    # cannot divide it, so the options are 32-wide at most.
    small = flex.cuda_kernel_options(32, 32, 128, 128, torch.bfloat16, H200)
    assert small["BLOCK_M"] == small["BLOCK_N"] == 32
    assert small["USE_TMA"]
    # Not sm_90, float32 or head dim 256: not the tuned set.
    for args in ((128, 128, 128, 128, torch.bfloat16, A100),
                 (128, 128, 128, 128, torch.float32, H200),
                 (128, 128, 256, 256, torch.bfloat16, H200)):
        assert flex.cuda_kernel_options(*args) != tuned, args
    # Head dim 256 on an H200 with 16-bit inputs: 2 * 128 * 512 B per K/V stage
    # plus the Q tile would exceed 227 KiB at 128 x 128 x 2 stages.
    big = flex.cuda_kernel_options(128, 128, 256, 256, torch.bfloat16, H200)
    assert 2 * (big["BLOCK_M"] * 256 + big["num_stages"] * big["BLOCK_N"] * 512) <= 227 * 1024


def test_cuda_options_for_other_q_and_kv_blocks_and_v_head_dim():
    opts = flex.cuda_kernel_options(64, 32, 192, 128, torch.bfloat16, H200)
    assert 64 % opts["BLOCK_M"] == 0 and 32 % opts["BLOCK_N"] == 0
    assert opts["USE_TMA"]
    # A v head dim whose rows are not 16-byte multiples: no TMA.
    assert not flex.cuda_kernel_options(64, 64, 64, 36, torch.bfloat16, H200)["USE_TMA"]


@pytest.mark.parametrize("bs", [1, 4, 8, 12, 20, 24, 40, 100, 127])
def test_every_block_size_gets_a_grid_the_cuda_kernel_can_tile(bs):
    grid = flex.choose_mask_block_size(bs, "cuda")
    assert grid % bs == 0 and grid % 16 == 0
    assert grid == bs * 16 // math.gcd(bs, 16)  # the smallest such grid
    opts = flex.cuda_kernel_options(grid, grid, 64, 64, torch.bfloat16, H200)
    assert grid % opts["BLOCK_M"] == 0 and grid % opts["BLOCK_N"] == 0
    # CPU's template takes any block: the lists stay as they are.
    assert flex.choose_mask_block_size(bs, "cpu") == bs


def test_no_tile_for_the_block_is_an_error_naming_it():
    with pytest.raises(ValueError, match="block 24 x 24"):
        flex.cuda_kernel_options(24, 24, 64, 64, torch.bfloat16, H200)


def test_mask_block_size_must_be_a_multiple_of_the_block():
    idx = torch.zeros(1, 1, 2, 2, dtype=torch.int32)
    lens = torch.ones(1, 1, 2, dtype=torch.int32)
    with pytest.raises(StemIndexerInputError,
                       match=r"^block_mask: mask_block_size must be a multiple of block_size"):
        flex.block_mask(idx, lens, block_size=20, q_len=40, kv_len=40, mask_block_size=30)


# --------------------------------------------------------------------------- #
# Compiled FlexAttention (inductor's C++ template on CPU, its Triton kernel on CUDA)
# --------------------------------------------------------------------------- #


def _random_selection(gen, batch, heads, qb, kb, q_lens, kv_lens, bs):
    """Causal, right-down aligned rows: a random subset of each row's visible
    blocks (at least the diagonal one), ascending, -1 padded."""
    idx = torch.full((batch, heads, qb, kb), -1, dtype=torch.int32)
    lens = torch.zeros(batch, heads, qb, dtype=torch.int32)
    for b in range(batch):
        qbb, kbb = -(-q_lens[b] // bs), -(-kv_lens[b] // bs)
        for h in range(heads):
            for i in range(qbb):
                s2 = min(max(kbb - qbb + i + 1, 0), kbb)
                if s2 == 0:
                    continue
                keep = (torch.rand(s2, generator=gen) < 0.5).nonzero().flatten().tolist()
                row = sorted(set(keep) | {s2 - 1})
                idx[b, h, i, :len(row)] = torch.tensor(row, dtype=torch.int32)
                lens[b, h, i] = len(row)
    return idx, lens


def _dense_reference(q, k, v, idx, lens, bs, q_lens, kv_lens, scale):
    """The float64 reference under the selection's token mask, and the mask."""
    allowed = token_mask(idx, lens, bs, q.shape[2], k.shape[2], q_lens, kv_lens)
    return reference_attention(q, k, v, allowed, scale=scale), allowed


def _inputs(bs, q_lens, kv_lens, seed=0, heads=4, kv_heads=2, d=16):
    gen = torch.Generator().manual_seed(seed)
    batch = len(q_lens)
    qb, kb = -(-max(q_lens) // bs), -(-max(kv_lens) // bs)
    q = torch.randn(batch, heads, qb * bs, d, generator=gen)
    k = torch.randn(batch, kv_heads, kb * bs, d, generator=gen)
    v = torch.randn(batch, kv_heads, kb * bs, d, generator=gen)
    idx, lens = _random_selection(gen, batch, heads, qb, kb, q_lens, kv_lens, bs)
    return q, k, v, idx, lens


class _EagerFlexCounter:
    """Counts FlexAttention's eager (dense) evaluations while installed."""

    def __init__(self, monkeypatch):
        self.calls = 0
        module = importlib.import_module("torch._higher_order_ops.flex_attention")
        real = module.math_attention

        def counting(*args, **kwargs):
            if not torch.compiler.is_compiling():
                self.calls += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, "math_attention", counting)


def _coarse_case(device):
    """A 20-token Stem block (no CUDA tile divides it) on the 80-token grid
    CUDA would use, with tails and a batch of two; q/k/v and the mask on
    ``device``, the float64 reference and the token mask on the CPU."""
    bs, q_lens, kv_lens = 20, [70, 50], [130, 90]
    q, k, v, idx, lens = _inputs(bs, q_lens, kv_lens, seed=3)
    grid = flex.choose_mask_block_size(bs, "cuda")
    flex._COARSE_REPORTED.discard((bs, grid))
    with pytest.warns(RuntimeWarning, match="cannot tile 20-token blocks"):
        mask = flex.block_mask(idx.to(device), lens.to(device), block_size=bs, q_len=q.shape[2],
                               kv_len=k.shape[2], q_lens=torch.tensor(q_lens, device=device),
                               kv_lens=torch.tensor(kv_lens, device=device),
                               mask_block_size=grid)
    want, allowed = _dense_reference(q, k, v, idx, lens, bs, q_lens, kv_lens, 0.25)
    q, k, v = (x.to(device) for x in (q, k, v))
    return q, k, v, mask, grid, q_lens, want, allowed


def test_coarse_grid_lists_and_mask_are_exactly_the_selection(device):
    q, k, v, mask, grid, q_lens, want, allowed = _coarse_case(device)
    assert grid == 80 and tuple(mask.BLOCK_SIZE) == (grid, grid)
    assert mask.full_kv_num_blocks is None  # every coarse block is checked token by token
    batch, heads = allowed.shape[:2]
    for b in range(batch):
        for h in range(heads):
            # The mask_mod, token by token, is the reference's token mask
            # (on the valid queries: padded ones are cut from the output) ...
            for t in range(q_lens[b]):
                got = mask.mask_mod(*(torch.tensor(x, device=device) for x in (b, h, t)),
                                    torch.arange(k.shape[2], device=device))
                assert torch.equal(got.cpu(), allowed[b, h, t]), (b, h, t)
            # ... and the coarse lists hold exactly the coarse blocks with an allowed pair.
            for i in range(mask.kv_num_blocks.shape[2]):
                listed = set(mask.kv_indices[b, h, i, :mask.kv_num_blocks[b, h, i]].tolist())
                needed = {j // grid for j in range(k.shape[2])
                          if allowed[b, h, i * grid:(i + 1) * grid, j].any()}
                assert listed == needed, (b, h, i)


@pytest.mark.slow
def test_coarse_grid_through_compiled_flex_attention(monkeypatch, device):
    q, k, v, mask, grid, q_lens, want, allowed = _coarse_case(device)
    eager = _EagerFlexCounter(monkeypatch)
    out, _ = flex.flex_attention_forward(q, k, v, mask, 0.25)
    assert eager.calls == 0
    assert out.device == q.device
    out = out.cpu()
    for b in range(len(q_lens)):
        torch.testing.assert_close(out[b, :, :q_lens[b]].double(), want[b, :, :q_lens[b]],
                                   rtol=1e-4, atol=1e-5)


def test_one_compilation_serves_many_lengths_and_never_runs_eagerly(monkeypatch, device):
    """Ten sequence lengths (past Dynamo's default limit of 8 recompiles, where
    a static-shape compile would fall back to eager FlexAttention): at most
    two compilations (the first call's sizes, then symbolic ones), no eager
    evaluation, and every output equals dense attention under the mask."""
    from torch._dynamo.utils import counters

    bs = 16
    eager = _EagerFlexCounter(monkeypatch)
    graphs_before = counters["stats"]["unique_graphs"]
    lengths = [48 + 16 * n + (n % 3) for n in range(10)]  # 3 .. 12 blocks, tails
    for n, seq in enumerate(lengths):
        q, k, v, idx, lens = _inputs(bs, [seq], [seq], seed=n, heads=2, kv_heads=1, d=8)
        seqs = torch.tensor([seq], device=device)
        mask = flex.block_mask(idx.to(device), lens.to(device), block_size=bs, q_len=q.shape[2],
                               kv_len=k.shape[2], q_lens=seqs, kv_lens=seqs)
        out, _ = flex.flex_attention_forward(*(x.to(device) for x in (q, k, v)), mask, 0.5)
        assert out.device.type == torch.device(device).type
        out = out.cpu()
        want, _ = _dense_reference(q, k, v, idx, lens, bs, [seq], [seq], 0.5)
        torch.testing.assert_close(out[:, :, :seq].double(), want[:, :, :seq],
                                   rtol=1e-4, atol=1e-5)
    compiles = counters["stats"]["unique_graphs"] - graphs_before
    assert compiles <= 2, f"{compiles} compilations for {len(lengths)} lengths"
    assert eager.calls == 0


def test_recompile_limit_is_an_error_not_an_eager_run(monkeypatch, device):
    """Past the recompile limit Dynamo would run FlexAttention eagerly; here
    the call raises instead. Forced with a limit of one compilation (the
    function's own limit, ``RECOMPILE_LIMIT`` otherwise) and a second dtype
    (a guard every compilation has)."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    eager = _EagerFlexCounter(monkeypatch)
    bs = 16
    monkeypatch.setattr(flex, "_compiled", None)  # a fresh compiled function
    q, k, v, idx, lens = (x.to(device) for x in _inputs(bs, [48], [48], heads=2, kv_heads=1,
                                                        d=8))
    mask = flex.block_mask(idx, lens, block_size=bs, q_len=48, kv_len=48)
    for name in ("recompile_limit", "cache_size_limit"):
        if name in flex._COMPILE_CONFIG:
            monkeypatch.setitem(flex._COMPILE_CONFIG, name, 1)
    flex.flex_attention_forward(q, k, v, mask, 0.5)
    with pytest.raises(FailOnRecompileLimitHit):
        flex.flex_attention_forward(q.double(), k.double(), v.double(), mask, 0.5)
    assert eager.calls == 0
