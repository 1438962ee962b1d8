"""``IndexCache.write`` on CUDA tensors against the CPU write on the same slots.

An engine on a GPU writes its indexer cache there: the CUDA write must leave
what the CPU write leaves. On CUDA the key sums accumulate with atomics, in
no fixed order, so:

* with integer-valued keys and values every order gives the same float32
  sums and the same norms: after every write the CUDA cache holds the CPU
  cache's bits (``ksum``, ``vmax``, ``filled``), and so do the indexer
  inputs read back from it (``inputs``: kflat, vbias);
* with random values the sums agree up to summation order, ``filled``
  exactly.

The writes are an engine's: a chunk that ends inside a page and the next
one continuing it, a whole sequence at once with tokens that have no slot
(negative, skipped), a page freed and written again from offset 0, and
writes that leave a page unusable (an offset skipped, a slot repeated, a
page continued where it did not stop). CUDA only (the GPU check runs it).
"""

from __future__ import annotations

import pytest
import torch

from stem_indexer import IndexCache

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PAGE, STRIDE, HKV, DIM, PAGES, BLOCK = 32, 8, 2, 16, 24, 64
# Sequences read back at the end: their pages (table order) and lengths.
SEQUENCES = {"chunked": ([3, 7, 1], 80), "padded": ([10, 11], 50)}


def _slots(pages: list[int], start: int, stop: int) -> torch.Tensor:
    """The slots of a sequence's tokens ``start .. stop - 1`` on ``pages``."""
    pos = torch.arange(start, stop)
    return torch.tensor(pages)[pos // PAGE] * PAGE + pos % PAGE


def engine_writes(dtype: torch.dtype, integer: bool, seed: int = 0) -> list[tuple]:
    """``(label, key, value, slots)`` on the CPU, in an engine's order."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        if integer:
            return tuple(torch.randint(-3, 4, (n, HKV, DIM), generator=gen).to(dtype)
                         for _ in range(2))
        return tuple(torch.randn(n, HKV, DIM, generator=gen).to(dtype) for _ in range(2))

    writes = []
    for lo, hi in ((0, 37), (37, 64), (64, 80)):  # chunks ending inside pages 7 and 1
        writes.append((f"chunk {lo}..{hi}", *tokens(hi - lo), _slots([3, 7, 1], lo, hi)))
    slots = _slots([10, 11], 0, 50)
    slots = torch.cat([slots[:10], torch.tensor([-1]), slots[10:30], torch.tensor([-5]),
                       slots[30:]])
    writes.append(("a sequence at once, two tokens without a slot", *tokens(52), slots))
    writes.append(("page 15 written", *tokens(20), _slots([15], 0, 20)))
    writes.append(("page 15 freed and written again", *tokens(9), _slots([15], 0, 9)))
    writes.append(("an offset skipped", *tokens(9),
                   torch.cat([_slots([12], 0, 4), _slots([12], 5, 10)])))
    writes.append(("a slot repeated", *tokens(7),
                   torch.cat([_slots([13], 0, 4), _slots([13], 3, 6)])))
    writes.append(("a page continued where it did not stop", *tokens(4),
                   _slots([1], 20, 24)))
    return writes


def _assert_alike(got: IndexCache, want: IndexCache, exact: bool, label: str) -> None:
    assert torch.equal(got.filled.cpu(), want.filled), label
    for name in ("ksum", "vmax"):
        a, b = getattr(got, name).cpu(), getattr(want, name)
        if exact:
            assert torch.equal(a, b), (label, name, (a - b).abs().max())
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{label}: {name}")


def _assert_inputs_alike(got: IndexCache, want: IndexCache, exact: bool) -> None:
    for label, (pages, seq_len) in SEQUENCES.items():
        for oam in (True, False):
            a = got.inputs(torch.tensor(pages, device=got.ksum.device), seq_len, BLOCK, oam, 0.3)
            b = want.inputs(torch.tensor(pages), seq_len, BLOCK, oam, 0.3)
            kflat, vbias = (x.cpu() for x in a)
            if exact:
                assert torch.equal(kflat.view(torch.int16), b[0].view(torch.int16)), label
            else:  # float32 sums in another order, then one bfloat16 rounding
                torch.testing.assert_close(kflat.float(), b[0].float(), rtol=8e-3, atol=1e-5)
            torch.testing.assert_close(vbias, b[1], rtol=1e-5, atol=1e-6, msg=label)


def writes_alike(device: str, dtype: torch.dtype, integer: bool) -> IndexCache:
    """The engine's writes on ``device`` and on the CPU, compared after each;
    returns the CPU cache."""
    host = IndexCache.allocate(PAGES, PAGE, STRIDE, HKV, DIM)
    dev = IndexCache.allocate(PAGES, PAGE, STRIDE, HKV, DIM, device=device)
    for label, key, value, slots in engine_writes(dtype, integer):
        host.write(key, value, slots)
        dev.write(key.to(device), value.to(device), slots.to(device))
        _assert_alike(dev, host, integer, label)
    _assert_inputs_alike(dev, host, integer)
    return host


@cuda
@pytest.mark.parametrize("dtype,integer", [(torch.bfloat16, True), (torch.float32, True),
                                           (torch.float16, False), (torch.bfloat16, False)],
                         ids=["bf16-integer", "f32-integer", "f16-random", "bf16-random"])
def test_cuda_write_is_the_cpu_write(dtype, integer):
    host = writes_alike("cuda", dtype, integer)
    # The writes reached every case they name (on the CPU: the independent side).
    filled = host.filled.tolist()
    assert [filled[p] for p in (3, 7, 1, 10, 11, 15)] == [32, 32, -1, 32, 18, 9]
    assert filled[12] == filled[13] == -1
