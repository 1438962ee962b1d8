"""attention.py: block-sparse attention and stem_attention against dense references."""

from __future__ import annotations

import warnings

import pytest
import torch

import stem_indexer
from stem_indexer.pipeline import checks, dispatch
from stem_indexer.surfaces.attention import block_sparse_attention, dense_attention, stem_attention
from stem_indexer.operator.ops import gather_attention
from stem_indexer.testing import reference_attention, token_mask

from _helpers import SMALL, cpu_dense_above, host, qkv


def random_selection(batch, hq, qmax, kmax, gen, empty_rate=0.15):
    idx = torch.full((batch, hq, qmax, kmax), -1, dtype=torch.int32)
    seq_len = torch.zeros(batch, hq, qmax, dtype=torch.int32)
    for b in range(batch):
        for h in range(hq):
            for i in range(qmax):
                if torch.rand((), generator=gen) < empty_rate:
                    continue
                n = int(torch.randint(1, kmax + 1, (), generator=gen))
                picked = torch.randperm(kmax, generator=gen)[:n].sort().values
                idx[b, h, i, :n] = picked.int()
                seq_len[b, h, i] = n
    return idx, seq_len


SHAPES = [  # (B, Hq, Hkv, Sq, Skv, D, Bs, q_lens, kv_lens)
    (1, 2, 2, 32, 32, 8, 8, None, None),  # whole blocks
    (2, 4, 2, 37, 45, 8, 8, None, None),  # GQA, tails, q shorter than kv
    (3, 4, 1, 29, 29, 4, 8, [29, 17, 1], [29, 17, 25]),  # padded batches, decode-like row
    (2, 2, 2, 40, 19, 8, 8, [40, 30], [19, 5]),  # kv shorter than q: early queries see nothing
    (1, 3, 3, 9, 70, 4, 16, None, None),  # one query block against many key blocks
]


def _to(device, *tensors):
    """The tensors on ``device`` (drawn on the CPU; the reference computes there)."""
    return tuple(t.to(device) for t in tensors)


def _skip_native_off_cpu(backend, device):
    if backend == "native" and device != "cpu":
        pytest.skip("backend 'native' runs on CPU tensors only")


def _ids(s):
    return f"B{s[0]}-Hq{s[1]}-Hkv{s[2]}-Sq{s[3]}-Skv{s[4]}-Bs{s[6]}" + ("-lens" if s[7] else "")


def _random_case(shape, seed):
    """Random q/k/v and a random block selection for ``shape``."""
    batch, hq, hkv, sq, skv, dim, bs, _, _ = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, sq, dim, generator=gen)
    k = torch.randn(batch, hkv, skv, dim, generator=gen)
    v = torch.randn(batch, hkv, skv, dim, generator=gen)
    idx, seq_len = random_selection(batch, hq, -(-sq // bs), -(-skv // bs), gen)
    return q, k, v, idx, seq_len


def _backends() -> list:
    """Every backend that runs here, causal and not; compiled FlexAttention on
    two shapes (each new shape or mask compiles for seconds on CPU: the
    default run compiles one, the slow tier the other three)."""
    out = [(s, "gather") for s in SHAPES]
    if dispatch._native() is not None:
        out += [(s, "native") for s in SHAPES]
    out += [(s, "flex") for s in SHAPES[1:3]]
    first = (SHAPES[1], "flex", True)
    return [pytest.param(s, b, causal, id=f"{_ids(s)}-{b}-{'causal' if causal else 'full'}",
                         marks=[pytest.mark.slow] if b == "flex" and (s, b, causal) != first
                         else [])
            for s, b in out for causal in (True, False)]


@pytest.mark.parametrize("shape, backend, causal", _backends())
def test_block_sparse_matches_masked_dense(shape, backend, causal, device):
    _skip_native_off_cpu(backend, device)
    batch, hq, hkv, sq, skv, dim, bs, q_lens, kv_lens = shape
    q, k, v, idx, seq_len = _random_case(shape, sum(shape[:7]))
    out = block_sparse_attention(*_to(device, q, k, v, idx, seq_len), stem_block_size=bs,
                                 causal=causal, q_lens=q_lens, kv_lens=kv_lens, backend=backend)
    out = host(out, device)
    mask = token_mask(idx, seq_len, bs, sq, skv, q_lens, kv_lens, causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)


def _triton_fits(shape) -> bool:
    """Whether backend "triton" runs ``shape`` causally: every batch's keys
    before its queries are whole blocks."""
    batch, _, _, sq, skv, _, bs, q_lens, kv_lens = shape
    pairs = zip(q_lens or [sq] * batch, kv_lens or [skv] * batch)
    return all(kv >= q and (kv - q) % bs == 0 for q, kv in pairs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [s for s in SHAPES if _triton_fits(s)], ids=_ids)
def test_cuda_triton_backend_matches_masked_dense(shape):
    """block_sparse_attention(backend="triton"), the paged Triton kernel
    compiled, on the shapes it runs (the interpreter runs it in
    tests/test_paged.py)."""
    batch, hq, hkv, sq, skv, dim, bs, q_lens, kv_lens = shape
    q, k, v, idx, seq_len = _random_case(shape, sum(shape[:7]))
    out = block_sparse_attention(*_to("cuda", q, k, v, idx, seq_len), stem_block_size=bs,
                                 q_lens=q_lens, kv_lens=kv_lens, backend="triton").cpu()
    mask = token_mask(idx, seq_len, bs, sq, skv, q_lens, kv_lens, True)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", [b for b in ("gather", "native", "flex")
                                     if b != "native" or dispatch._native() is not None])
def test_block_sparse_softcap_matches_capped_masked_dense(backend, device):
    """Soft-capped scores (Gemma 2) on each backend: FlexAttention takes the
    cap as a score_mod, the others cap in their own softmax."""
    _skip_native_off_cpu(backend, device)
    shape = SHAPES[1]
    batch, hq, hkv, sq, skv, dim, bs, _, _ = shape
    q, k, v, idx, seq_len = _random_case(shape, 23)
    q = q * 4  # large logits, where the cap matters
    out = block_sparse_attention(*_to(device, q, k, v, idx, seq_len), stem_block_size=bs,
                                 softcap=2.0, backend=backend)
    out = host(out, device)
    mask = token_mask(idx, seq_len, bs, sq, skv, None, None, True)
    capped = reference_attention(q, k, v, mask, softcap=2.0)
    torch.testing.assert_close(out.double(), capped, rtol=1e-5, atol=1e-5)
    assert (capped - reference_attention(q, k, v, mask)).abs().max() > 1e-2  # the cap changed it


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lens", [None, ([64, 40], [64, 40])], ids=["full", "lens"])
def test_complete_rows_and_sparse_rows_together(causal, lens, device):
    """Rows listing every block they see (as the budget makes early rows) plus
    sparse later rows: the result is exactly the masked one."""
    batch, hq, hkv, seq, dim, bs = 2, 4, 2, 64, 8, 8
    q_lens, kv_lens = lens if lens else (None, None)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(batch, hq, seq, dim, generator=gen)
    k = torch.randn(batch, hkv, seq, dim, generator=gen)
    v = torch.randn(batch, hkv, seq, dim, generator=gen)
    nb = seq // bs
    idx = torch.full((batch, hq, nb, nb), -1, dtype=torch.int32)
    seq_len = torch.zeros(batch, hq, nb, dtype=torch.int32)
    for b in range(batch):
        qb = -(-(q_lens[b] if q_lens else seq) // bs)
        for h in range(hq):
            for i in range(qb):
                visible = i + 1 if causal else qb
                keep = list(range(visible)) if i < 4 else sorted({0, i, i - 1, (3 * i + h) % i})
                idx[b, h, i, :len(keep)] = torch.tensor(keep, dtype=torch.int32)
                seq_len[b, h, i] = len(keep)
    out = block_sparse_attention(*_to(device, q, k, v, idx, seq_len), stem_block_size=bs,
                                 causal=causal, q_lens=q_lens, kv_lens=kv_lens)
    out = host(out, device)
    mask = token_mask(idx, seq_len, bs, seq, seq, q_lens, kv_lens, causal)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("score_bytes", [8 * 8 * 4 * 2, 8 * 8 * 4 * 3, 1 << 20],
                         ids=["keys-split", "split-and-padded", "padded-chunks"])
@pytest.mark.parametrize("shape", SHAPES[1:4], ids=[_ids(s) for s in SHAPES[1:4]])
def test_gather_chunking_is_exact(shape, causal, score_bytes, monkeypatch, device):
    """Lists split across key segments (running max / sum) and rows of
    different list lengths padded into one chunk give the masked result."""
    monkeypatch.setattr(gather_attention, "SCORE_BYTES", score_bytes)
    batch, hq, hkv, sq, skv, dim, bs, q_lens, kv_lens = shape
    q, k, v, idx, seq_len = _random_case(shape, sum(shape[:7]) + 1)
    out = block_sparse_attention(*_to(device, q, k, v, idx, seq_len), stem_block_size=bs,
                                 causal=causal, q_lens=q_lens, kv_lens=kv_lens, backend="gather")
    out = host(out, device)
    mask = token_mask(idx, seq_len, bs, sq, skv, q_lens, kv_lens, causal)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, "strided"])
def test_gather_dtypes_and_layouts(dtype, device):
    """Converted / padded (batch, KV head) slices: bf16 (float32 compute,
    bf16 out), float64 (float64 compute), non-contiguous float32 q; GQA, a
    key tail, padded lengths, and a KV head whose rows are all empty."""
    gen = torch.Generator().manual_seed(21)
    batch, hq, hkv, sq, skv, dim, bs = 2, 4, 2, 40, 44, 8, 8
    dt = torch.float32 if dtype == "strided" else dtype
    q = torch.randn(batch, hq, sq, dim, generator=gen).to(dt)
    if dtype == "strided":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k = torch.randn(batch, hkv, skv, dim, generator=gen).to(dt)
    v = torch.randn(batch, hkv, skv, dim, generator=gen).to(dt)
    idx, seq_len = random_selection(batch, hq, 5, 6, gen)
    seq_len[1, 2:] = 0  # batch 1, KV head 1: nothing listed
    q_lens, kv_lens = [40, 27], [44, 30]
    on_device = _to(device, q, k, v, idx, seq_len)
    assert on_device[0].is_contiguous() == (dtype != "strided")  # .to keeps the layout
    out = block_sparse_attention(*on_device, stem_block_size=bs, q_lens=q_lens,
                                 kv_lens=kv_lens, backend="gather")
    out = host(out, device)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.equal(out[1, 2:], torch.zeros_like(out[1, 2:]))
    mask = token_mask(idx, seq_len, bs, sq, skv, q_lens, kv_lens, True)
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, mask), rtol=tol, atol=tol)


def test_bf16_and_unsorted_lists(device):
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(1, 2, 48, 16, generator=gen).bfloat16()
    k = torch.randn(1, 1, 48, 16, generator=gen).bfloat16()
    v = torch.randn(1, 1, 48, 16, generator=gen).bfloat16()
    idx, seq_len = random_selection(1, 2, 3, 3, gen, empty_rate=0.0)
    shuffled = idx.clone()
    shuffled[..., :2] = idx[..., :2].flip(-1)
    shuffled = torch.where(seq_len[..., None] >= 2, shuffled, idx)
    out = block_sparse_attention(*_to(device, q, k, v, shuffled, seq_len), stem_block_size=16)
    out = host(out, device)
    assert out.dtype == torch.bfloat16
    ref = reference_attention(q, k, v, token_mask(idx, seq_len, 16, 48, 48, None, None, True))
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def test_empty_rows_and_padded_queries_are_zero(device):
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(2, 2, 16, 4, generator=gen)
    k = torch.randn(2, 2, 16, 4, generator=gen)
    v = torch.randn(2, 2, 16, 4, generator=gen)
    idx = torch.tensor([0, 1]).expand(2, 2, 2, 2).clone().int()
    seq_len = torch.full((2, 2, 2), 2, dtype=torch.int32)
    seq_len[0, 1, 1] = 0
    out = block_sparse_attention(*_to(device, q, k, v, idx, seq_len), stem_block_size=8,
                                 q_lens=[16, 5])
    out = host(out, device)
    assert torch.equal(out[0, 1, 8:], torch.zeros(8, 4))
    assert torch.equal(out[1, :, 5:], torch.zeros(2, 11, 4))
    assert out[0, 0].abs().sum() > 0


@pytest.mark.parametrize("mutate, arg", [
    (lambda a: a["idx"].__setitem__((0, 0, 0, 0), 5), r"sparse_indices\[0, 0, 0, 0\]"),
    (lambda a: a["idx"].__setitem__((0, 0, 0, 1), 0), r"sparse_indices\[0, 0, 0, 1\]"),
    (lambda a: a["len"].__setitem__((0, 1, 0), 4), r"sparse_seq_len\[0, 1, 0\]"),
    (lambda a: a.update(idx=a["idx"][:, :, :1]), "sparse_indices"),
    (lambda a: a.update(idx=a["idx"].float()), "sparse_indices"),
    (lambda a: a.update(len=a["len"][0]), "sparse_seq_len"),
    (lambda a: a.update(k=a["k"][:, :1].expand(1, 3, 24, 4), v=a["v"][:, :1].expand(1, 3, 24, 4)),
     "q"),
    (lambda a: a.update(v=a["v"].double()), "v"),
    (lambda a: a.update(stem_block_size=0), "stem_block_size"),
    (lambda a: a.update(kv_lens=[25]), r"kv_lens\[0\]"),
    (lambda a: a.update(backend="cuda"), "backend"),
    (lambda a: a.update(causal=None), "causal"),
    (lambda a: a.update(scale=float("inf")), "scale"),
])
def test_block_sparse_invalid_inputs(mutate, arg, device):
    """Each refusal, with the selection checked on the tensors' device."""
    gen = torch.Generator().manual_seed(14)
    a = dict(q=torch.randn(1, 2, 24, 4, generator=gen), k=torch.randn(1, 2, 24, 4, generator=gen),
             v=torch.randn(1, 2, 24, 4, generator=gen),
             idx=torch.tensor([0, 1, -1]).expand(1, 2, 3, 3).clone().int(),
             len=torch.full((1, 2, 3), 2, dtype=torch.int32))
    a = {name: t.to(device) for name, t in a.items()}
    a["stem_block_size"] = 8
    mutate(a)
    with pytest.raises(stem_indexer.StemIndexerInputError,
                       match="^block_sparse_attention: " + arg):
        block_sparse_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("idx"), a.pop("len"),
                               **a)


# --------------------------------------------------------------------------- #
# stem_attention
# --------------------------------------------------------------------------- #



@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["causal", "full"])
def test_stem_attention_is_the_indexer_selection(causal, device):
    """Long enough for the budget to drop blocks: the result is block-sparse
    attention over exactly the indexer's selection (with scale/stride folded;
    ``exact_tail=0``: no row widened, test_exact_tail_* cover the default)."""
    q, k, v = qkv(2, 4, 2, 1100, 1100, 8, 15, device=device)
    lens = [1100, 900]
    out = stem_attention(q, k, v, causal=causal, q_lens=lens, kv_lens=lens, dense_above=1.0,
                         exact_tail=0, **SMALL)
    inputs = stem_indexer.stem_inputs(q, k, v, q_lens=lens, kv_lens=lens, scale=8 ** -0.5 / 4,
                                      stem_block_size=16, stem_stride=4)
    idx, seq_len = (host(t, device) for t in stem_indexer.stem_indexer(
        *inputs, causal=causal, stem_block_size=16, stem_stride=4))
    assert int(seq_len.sum()) < int((idx.shape[-1] * (seq_len > 0)).sum())  # really sparse
    mask = token_mask(idx, seq_len, 16, 1100, 1100, lens, lens, causal)
    torch.testing.assert_close(host(out, device).double(), reference_attention(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)
    dense = dense_attention(q, k, v, causal=causal, q_lens=lens, kv_lens=lens)
    assert (out - dense).abs().max() > 1e-4  # sparse, so not the dense result


def test_the_miss_check_widens_the_batches_whose_selection_misses(device):
    """``miss_check``: a batch whose selection keeps more than ``miss_check``
    less of its last sparse query block's exact attention (its last 16
    queries) than the heaviest blocks would attends every block it can see
    (float64 dense attention); a batch under it keeps the indexer's
    selection (the float64 masked reference). Each batch's miss is
    test_probe's float64 loop; the threshold sits between them, then under
    both."""
    from test_probe import miss_truth

    q, k, v = qkv(2, 4, 2, 1100, 1100, 8, 15, device=device)
    lens = [1100, 900]
    kw = dict(q_lens=lens, kv_lens=lens, dense_above=1.0, exact_tail=0, return_info=True,
              **SMALL)
    inputs = stem_indexer.stem_inputs(q, k, v, q_lens=lens, kv_lens=lens, scale=8 ** -0.5 / 4,
                                      stem_block_size=16, stem_stride=4)
    idx, seq_len = (host(t, device) for t in stem_indexer.stem_indexer(
        *inputs, stem_block_size=16, stem_stride=4))
    qh, kh = host(q, device), host(k, device)
    misses = []
    for b, n in enumerate(lens):
        qb = -(-n // 16)
        partial = [r for r in range(qb) if bool((seq_len[b, :, r] < r + 1).any())]
        misses.append(miss_truth(qh[b, :, :n], kh[b, :, :n], idx[b, :, :qb], seq_len[b, :, :qb],
                                 partial[-1:], context=0, seq_len=n, scale=8 ** -0.5, m=16,
                                 bs=16))
    assert abs(misses[0] - misses[1]) > 0.01, misses
    wide = int(misses[1] > misses[0])
    out, info = stem_attention(q, k, v, miss_check=sum(misses) / 2, **kw)
    dense = dense_attention(q, k, v, q_lens=lens, kv_lens=lens)
    mask = token_mask(idx, seq_len, 16, 1100, 1100, lens, lens, True)
    sparse = reference_attention(q, k, v, mask)
    out = host(out, device).double()
    torch.testing.assert_close(out[wide], host(dense, device).double()[wide], rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(out[1 - wide], sparse[1 - wide], rtol=1e-5, atol=1e-5)
    assert (out[wide] - sparse[wide]).abs().max() > 1e-4  # the widening changed that batch
    visible_wide = 4 * sum(i + 1 for i in range(-(-lens[wide] // 16)))
    assert info.path == "sparse" and info.kept_pairs == (
        int(seq_len[1 - wide].sum()) + visible_wide), info
    # Under both batches' misses: every batch dense, said so
    out, info = stem_attention(q, k, v, miss_check=min(misses) / 2, **kw)
    torch.testing.assert_close(host(out, device).double(), host(dense, device).double(),
                               rtol=1e-5, atol=1e-5)
    assert (info.path, info.reason, info.density) == ("dense", "miss check", 1.0), info


def test_the_miss_check_widens_from_its_first_position(device):
    """``miss_check_from``: under any miss, a batch's query rows before it keep
    the indexer's selection (the float64 masked reference) and its rows from
    it on attend every key they can see; a batch no longer than it is not
    checked (its selection everywhere)."""
    q, k, v = qkv(2, 4, 2, 1100, 1100, 8, 16, device=device)
    lens, first = [1100, 400], 512
    budget = dict(SMALL, k_block_num_rate_medium=0.0, k_block_num_bias_medium=8)
    inputs = stem_indexer.stem_inputs(q, k, v, q_lens=lens, kv_lens=lens, scale=8 ** -0.5 / 4,
                                      **SMALL)
    idx, seq_len = (host(t, device) for t in stem_indexer.stem_indexer(*inputs, **budget))
    out, info = stem_attention(q, k, v, q_lens=lens, kv_lens=lens, dense_above=1.0,
                               exact_tail=0, return_info=True, miss_check=1e-9,
                               miss_check_from=first, **budget)
    mask = token_mask(idx, seq_len, 16, 1100, 1100, lens, lens, True)
    t, j = torch.arange(1100)[:, None], torch.arange(1100)[None, :]
    every = (j <= t) & (t < lens[0])
    mask[0, :, first:] = every[first:]
    torch.testing.assert_close(host(out, device).double(), reference_attention(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)
    widened = 4 * sum(r + 1 for r in range(first // 16, -(-lens[0] // 16)))  # every block
    kept = int(seq_len[0, :, :first // 16].sum()) + int(seq_len[1].sum()) + widened
    assert (info.path, info.kept_pairs) == ("sparse", kept), info
    # the sparse rows before it really drop blocks, so the mask is not dense there
    assert not torch.equal(mask[0, :, :first], every[:first].expand(4, -1, -1))


@pytest.mark.parametrize("kw, arg", [(dict(miss_check=1.5), "miss_check"),
                                     (dict(miss_check_queries=0), "miss_check_queries"),
                                     (dict(miss_check_blocks=None), "miss_check_blocks"),
                                     (dict(miss_check_from=-1), "miss_check_from"),
                                     (dict(miss_check_from=1.0), "miss_check_from")])
def test_bad_miss_check_arguments_name_themselves(kw, arg):
    q, k, v = qkv(1, 2, 2, 64, 64, 8, 1)
    with pytest.raises(stem_indexer.StemIndexerInputError, match=f"stem_attention: {arg} "):
        stem_attention(q, k, v, **kw)


@pytest.mark.parametrize("change", [dict(alpha=0.3), dict(oam=False), dict(oam_lambda=3.0),
                                    dict(initial_blocks=1, window_size=1)],
                         ids=["alpha", "no-oam", "oam-lambda", "sink-window"])
def test_stem_attention_parameters_reach_the_indexer(change, device):
    """Each parameter changes the selection (here), and the result is
    attention on exactly the indexer's selection with that parameter: the
    float64 masked reference on the blocks the op keeps."""
    q, k, v = qkv(1, 2, 2, 1100, 1100, 8, 16, device=device)
    out = stem_attention(q, k, v, **change, dense_above=1.0, exact_tail=0, **SMALL)
    oam = {name: change[name] for name in ("oam", "oam_lambda") if name in change}
    indexer = {name: value for name, value in change.items() if name not in oam}

    def selection(oam, indexer):
        inputs = stem_indexer.stem_inputs(q, k, v, scale=8 ** -0.5 / 4, **oam, **SMALL)
        return stem_indexer.stem_indexer(*inputs, **indexer, **SMALL)

    idx, seq_len = (host(t, device) for t in selection(oam, indexer))
    default_idx, default_len = (host(t, device) for t in selection({}, {}))
    assert not (torch.equal(idx, default_idx) and torch.equal(seq_len, default_len))
    mask = token_mask(idx, seq_len, 16, 1100, 1100, None, None, True)
    torch.testing.assert_close(host(out, device).double(), reference_attention(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tail, prompt", [
    (128, None),            # each sequence's last 128 tokens: 8 or 9 blocks of 16
    pytest.param(1, None, marks=pytest.mark.slow),     # one token: the block holding it
    pytest.param(5000, None, marks=pytest.mark.slow),  # past the prompts: every row, dense
    (100, [1100, 1500]),    # the second sequence is a chunk before its prompt's end
], ids=["128", "1", "all", "early-chunk"])
def test_exact_tail_rows_attend_to_every_block(tail, prompt, device):
    """The query blocks holding the prompt's last ``tail`` tokens attend to
    every block their tokens can see (the float64 dense reference on them);
    every other row is the indexer's selection, bit for bit as without the
    option; the kept pairs count the widened rows. 128 is the default."""
    q, k, v = qkv(2, 4, 2, 1100, 1100, 8, 15, device=device)
    lens = [1100, 900]
    kw = dict(q_lens=lens, kv_lens=lens, num_prompt_tokens=prompt, dense_above=1.0,
              return_info=True, **SMALL)
    base, base_info = stem_attention(q, k, v, exact_tail=0, **kw)
    out, info = stem_attention(q, k, v, exact_tail=tail, **kw)
    if tail == 128:
        assert torch.equal(stem_attention(q, k, v, **kw)[0], out)
    base, out = host(base, device), host(out, device)
    inputs = stem_indexer.stem_inputs(q, k, v, q_lens=lens, kv_lens=lens, scale=8 ** -0.5 / 4,
                                      **SMALL)
    prompt_tokens = None if prompt is None else torch.tensor(prompt).int().to(device)
    idx, seq_len = (host(t, device) for t in stem_indexer.stem_indexer(
        *inputs, num_prompt_tokens=prompt_tokens, **SMALL))
    idx = torch.cat([idx, idx.new_full((*idx.shape[:3], 70 - idx.shape[3]), -1)], -1)
    widened = torch.zeros(2, 70, dtype=torch.bool)  # [batch, query block]
    for b, n in enumerate(lens):
        first = (prompt or lens)[b] - tail  # no chunk offset: q_len == kv_len here
        for i in range(-(-n // 16)):
            if (i + 1) * 16 - 1 >= first and first < n:  # the block holds a tail token
                widened[b, i] = True
                idx[b, :, i] = torch.arange(70)
                seq_len[b, :, i] = i + 1  # causal, q_len == kv_len: blocks 0 .. i
    assert widened.any() and not widened.all()
    mask = token_mask(idx, seq_len, 16, 1100, 1100, lens, lens, True)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, mask), rtol=1e-5,
                               atol=1e-5)
    rows = widened.repeat_interleave(16, dim=1)[:, None, :1100, None].expand_as(out)
    assert torch.equal(out[~rows], base[~rows])
    assert info.kept_pairs == int(seq_len.sum()) > base_info.kept_pairs
    if tail == 5000:
        dense = host(dense_attention(q, k, v, q_lens=lens, kv_lens=lens), device)
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
    if prompt is not None:
        assert not widened[1].any() and torch.equal(out[1], base[1])


@pytest.mark.parametrize("q_len, kv_len, prompt, tail, rows", [
    (1000, 1000, 1000, 128, range(6, 8)),   # tokens 872..999: blocks 6 and 7 of 128
    (1000, 1000, 1000, 104, range(7, 8)),   # tokens 896..999: block 7 alone
    (1000, 1000, 1000, 0, range(0)),        # off
    (300, 1000, 1000, 128, range(1, 3)),    # last chunk: tokens 172..299 of the chunk
    (300, 1000, 1100, 128, range(2, 3)),    # the tail begins in this chunk: token 272 on
    (300, 1000, 2000, 128, range(0)),       # an early chunk: no tail token here
    (300, 1000, 1000, 5000, range(0, 3)),   # longer than the prompt: every block
    (0, 1000, 1000, 128, range(0)),         # no queries
])
def test_tail_rows_by_hand(q_len, kv_len, prompt, tail, rows):
    from stem_indexer.operator import contract
    assert contract.tail_rows(q_len, kv_len, prompt, tail, 128) == rows


@pytest.mark.parametrize("value", [-1, 1.5, True, "128"])
def test_exact_tail_is_checked(value):
    q, k, v = qkv(1, 2, 2, 64, 64, 8, 15)
    with pytest.raises(stem_indexer.StemIndexerInputError, match="exact_tail"):
        stem_attention(q, k, v, exact_tail=value, **SMALL)


@pytest.mark.parametrize("case", [
    dict(shape=(2, 4, 2, 100, 100, 8), lens=([100, 60], [100, 60])),  # few blocks: budget keeps all
    dict(shape=(2, 4, 2, 1, 700, 8), lens=([1, 1], [700, 300])),  # single-token decode
    dict(shape=(1, 2, 1, 16, 700, 8), lens=(None, None)),  # one query block: decode-like chunk
], ids=["short", "decode", "one-q-block"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_stem_attention_dense_fallback(case, causal, device):
    batch, hq, hkv, sq, skv, dim = case["shape"]
    q_lens, kv_lens = case["lens"]
    q, k, v = qkv(batch, hq, hkv, sq, skv, dim, 17)
    out = stem_attention(*_to(device, q, k, v), causal=causal, q_lens=q_lens, kv_lens=kv_lens,
                         **SMALL)
    out = host(out, device)
    full = torch.ones(batch, hq, -(-sq // 16), -(-skv // 16), dtype=torch.int32)
    everything = torch.arange(full.shape[-1], dtype=torch.int32).expand_as(full)
    mask = token_mask(everything, full.sum(-1), 16, sq, skv, q_lens, kv_lens, causal)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)


def test_stem_attention_dtype_scale_and_errors(device):
    q, k, v = qkv(1, 2, 1, 64, 64, 8, 18, torch.bfloat16, device=device)
    out = stem_attention(q, k, v, scale=0.2, **SMALL)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    out = host(out, device)
    every = torch.ones(1, 2, 4, 4, dtype=torch.bool)
    ref = reference_attention(q, k, v, token_mask(torch.arange(4).expand(1, 2, 4, 4),
                                                  every.sum(-1), 16, 64, 64), scale=0.2)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(stem_indexer.StemIndexerInputError, match="alpha"):
        stem_attention(q, k, v, alpha=0.0)
    with pytest.raises(stem_indexer.StemIndexerInputError, match="num_prompt_tokens"):
        stem_attention(q, k, v, num_prompt_tokens=[10])
    with pytest.raises(stem_indexer.StemIndexerInputError, match="stem_block_size"):
        stem_attention(q, k, v, stem_block_size=12, stem_stride=8)
    with pytest.raises(stem_indexer.StemIndexerInputError, match="block_size is not an indexer"):
        stem_attention(q, k, v, block_size=16)


_BAD_ARGS = [("causal", None), ("causal", "no"), ("backend", "xla"), ("oam", 1),
             ("min_q_blocks", 1.5)]


@pytest.mark.parametrize("call, name, value", [
    (call, name, value) for call in ("stem_attention", "stem_attention-dense",
                                     "block_sparse_attention")
    for name, value in _BAD_ARGS
    if call != "block_sparse_attention" or name not in ("oam", "min_q_blocks")])
def test_arguments_are_checked_whichever_path_runs(call, name, value):
    """Whether the call would run dense or sparse, a bad argument is refused."""
    seq = 1100 if call == "stem_attention" else 64  # 64 tokens: the dense path
    q, k, v = qkv(1, 2, 1, seq, seq, 8, 19)
    with pytest.raises(stem_indexer.StemIndexerInputError, match=f"{call.split('-')[0]}: {name}"):
        if call == "block_sparse_attention":
            idx = torch.zeros(1, 2, 4, 1, dtype=torch.int32)
            block_sparse_attention(q, k, v, idx, torch.ones(1, 2, 4, dtype=torch.int32),
                                   stem_block_size=16, **{name: value})
        else:
            stem_attention(q, k, v, **SMALL, **{name: value})


@pytest.mark.parametrize("seq", [64, 1100], ids=["dense-path", "sparse-path"])
def test_inference_only_the_same_on_every_path(seq, device):
    q, k, v = qkv(1, 2, 1, seq, seq, 8, 20, device=device)
    q.requires_grad_()
    paths = cpu_dense_above(device)  # 1100 tokens: the sparse path on every device
    with pytest.raises(stem_indexer.StemIndexerInputError, match="inference-only"):
        stem_attention(q, k, v, **paths, **SMALL)
    with torch.no_grad():
        out, info = stem_attention(q, k, v, return_info=True, **paths, **SMALL)
        assert out.shape == q.shape
    assert info.path == ("dense" if seq == 64 else "sparse")


@pytest.mark.parametrize("backend", [
    *[b for b in ("gather", "native") if b != "native" or dispatch._native() is not None],
    pytest.param("flex", marks=pytest.mark.slow)])  # compiles (seconds on CPU)
def test_nan_and_inf_in_padding_never_reach_valid_outputs(backend, device):
    """Padded positions of q, k and v (past the lengths, and the tail of the
    last block) hold NaN and inf; valid outputs equal those of clean inputs."""
    _skip_native_off_cpu(backend, device)
    shape = SHAPES[2]  # padded batches, tails, GQA
    batch, hq, hkv, sq, skv, dim, bs, q_lens, kv_lens = shape
    q, k, v, idx, seq_len = _to(device, *_random_case(shape, 23))
    dirty = [x.clone() for x in (q, k, v)]
    for b in range(batch):
        dirty[0][b, :, q_lens[b]:] = float("nan")
        dirty[1][b, :, kv_lens[b]:] = float("inf")
        dirty[2][b, :, kv_lens[b]:] = float("nan")
    args = dict(stem_block_size=bs, q_lens=q_lens, kv_lens=kv_lens, backend=backend)
    clean = block_sparse_attention(q, k, v, idx, seq_len, **args)
    out = block_sparse_attention(*dirty, idx, seq_len, **args)
    assert not out.isnan().any()
    torch.testing.assert_close(out, clean, rtol=1e-6, atol=1e-6)


def test_block_mask_splits_full_and_partial_blocks():
    """Hand-checked: 3 query blocks of 4 over 12 keys (kv_len 11: a tail),
    causal. Row 2 lists 0, 1, 2: blocks 0 and 1 are whole for every query of
    block 2; block 2 holds the diagonal and the tail, so it is partial."""
    idx = torch.tensor([[[[0, -1, -1], [0, 1, -1], [0, 1, 2]]]], dtype=torch.int32)
    seq_len = torch.tensor([[[1, 2, 3]]], dtype=torch.int32)
    mask = stem_indexer.block_mask(idx, seq_len, block_size=4, q_len=11, kv_len=11)
    assert mask.full_kv_num_blocks.tolist() == [[[0, 1, 2]]]
    assert mask.kv_num_blocks.tolist() == [[[1, 1, 1]]]
    assert mask.full_kv_indices[0, 0, 2, :2].tolist() == [0, 1]
    assert [mask.kv_indices[0, 0, i, 0].item() for i in range(3)] == [0, 1, 2]
    visible = [[bool(mask.mask_mod(torch.tensor(0), torch.tensor(0), torch.tensor(t),
                                   torch.tensor(j))) for j in range(12)] for t in (8, 10)]
    assert visible[0] == [j <= 8 for j in range(12)]
    assert visible[1] == [j <= 10 for j in range(12)]  # key 11 is past kv_len


def test_stem_attention_flex_backend_equals_gather(device):
    """The one-call path through compiled FlexAttention (on CPU, and on CUDA
    where it is the default) gives the gather backend's result on the same
    selection."""
    q, k, v = qkv(2, 4, 2, 1100, 1100, 8, 22, device=device)
    lens = [1100, 900]
    kw = dict(q_lens=lens, kv_lens=lens, return_info=True, **cpu_dense_above(device), **SMALL)
    flex, info = stem_attention(q, k, v, backend="flex", **kw)
    gather, _ = stem_attention(q, k, v, backend="gather", **kw)
    assert (info.path, info.backend) == ("sparse", "flex")
    torch.testing.assert_close(flex, gather, rtol=1e-5, atol=1e-5)


def test_native_backend_refuses_other_devices_and_dtypes():
    """backend="native" reads CPU memory as float32 or bfloat16: a CUDA
    tensor (its device pointer would crash the kernel) or float16 is refused
    before the kernel, naming the backend and the device or dtype. The rule
    is checked for a CUDA device directly, and through both public functions
    on meta tensors (which stand for any non-CPU device) and float16."""
    with pytest.raises(stem_indexer.StemIndexerInputError,
                       match=r"^f: backend 'native' runs on CPU tensors only \(q is on cuda:0\)"):
        checks.check_backend_fits("f", "native", torch.device("cuda:0"), torch.float32)
    checks.check_backend_fits("f", "gather", torch.device("cuda:0"), torch.float16)
    gen = torch.Generator().manual_seed(24)
    q, k, v = (torch.randn(1, 2, 24, 4, generator=gen) for _ in range(3))
    idx = torch.tensor([0, 1, -1]).expand(1, 2, 3, 3).clone().int()
    seq_len = torch.full((1, 2, 3), 2, dtype=torch.int32)
    for device, dtype, named in (("meta", torch.float32, "CPU tensors only .q is on meta"),
                                 ("cpu", torch.float16, "float32 and bfloat16 only .q is "
                                                        "torch.float16")):
        args = [x.to(device, dtype) for x in (q, k, v)]
        with pytest.raises(stem_indexer.StemIndexerInputError,
                           match=f"^block_sparse_attention: backend 'native' runs on {named}"):
            block_sparse_attention(*args, idx.to(device), seq_len.to(device),
                                   stem_block_size=8, backend="native")
        with pytest.raises(stem_indexer.StemIndexerInputError,
                           match=f"^stem_attention: backend 'native' runs on {named}"):
            stem_attention(*args, backend="native", **SMALL)
    # float16 on CPU: "auto" takes the torch path (a reported fallback,
    # tests/test_status.py), and gives the masked result.
    half = [x.half() for x in (q, k, v)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "stem_indexer: block-sparse attention on cpu float16")
        out = block_sparse_attention(*half, idx, seq_len, stem_block_size=8)
    mask = token_mask(idx, seq_len, 8, 24, 24, None, None, True)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), reference_attention(*half, mask), rtol=2e-3, atol=2e-3)


def test_one_spelling_of_block_size_and_stride_across_the_public_api():
    """stem_block_size / stem_stride (the operator's names) wherever a public
    function takes the indexer's block size or stride; nothing else spells them."""
    import inspect

    import stem_indexer.integrations.transformers as stem_hf

    public = [stem_indexer.stem_inputs, block_sparse_attention, stem_attention,
              stem_indexer.stem_attn_func, stem_indexer.stem_attn_varlen_func,
              stem_indexer.stem_indexer, stem_indexer.stem_indexer_metadata, stem_hf.register]
    for fn in public:
        names = set(inspect.signature(fn).parameters)
        assert not names & {"block_size", "stride"}, fn.__name__
    assert {"stem_block_size", "stem_stride"} <= set(stem_hf._stem_arguments())
    q, k, v = qkv(1, 2, 1, 64, 64, 8, 25)
    idx = torch.arange(4, dtype=torch.int32).expand(1, 2, 4, 4).contiguous()
    seq_len = torch.arange(1, 5, dtype=torch.int32).expand(1, 2, 4).contiguous()
    with pytest.raises(stem_indexer.StemIndexerInputError,
                       match="^block_sparse_attention: stem_block_size is required"):
        block_sparse_attention(q, k, v, idx, seq_len)
    for call in (lambda: stem_indexer.stem_inputs(q, k, v, block_size=16),
                 lambda: block_sparse_attention(q, k, v, idx, seq_len, block_size=16)):
        with pytest.raises(TypeError, match="unexpected keyword argument 'block_size'"):
            call()


def _reachable(q_len, kv_len, bs, qmax, kmax):
    """[qmax, kmax] bool by hand: key block j holds a key that some valid
    token of query block i sees (right-down causal, keys < kv_len)."""
    out = torch.zeros(qmax, kmax, dtype=torch.bool)
    for t in range(q_len):
        last = min(t + kv_len - q_len, kv_len - 1)
        if last >= 0:
            out[t // bs, : last // bs + 1] = True
    return out


@pytest.mark.parametrize("q_len, kv_len, exact", [
    (300, 300, True),            # 19 blocks: the budget keeps every block
    (55 * 16, 55 * 16, True),    # 55 prompt blocks: still all
    (56 * 16, 56 * 16, False),   # 56: the budget starts to drop blocks
    (325, 325, True),            # a tail block
    (40, 47, False),             # q/kv offset not a block multiple: a few keys past the lists
    (64, 1000, False),           # a chunk after a long prefix
])
def test_dense_when_the_budget_keeps_every_block_is_the_contracts_rule(q_len, kv_len, exact,
                                                                      monkeypatch, device):
    """contract.dense_is_exact (the rule's one home, beside the budget) is True
    exactly where the indexer's own lists hold every block the tokens reach
    (checked by hand here), so dense attention is then the sparse result;
    stem_attention takes its dense path by that rule and no other."""
    params = stem_indexer.IndexerParams(stem_block_size=16, stem_stride=4)
    lens = torch.tensor([q_len]), torch.tensor([kv_len])
    assert stem_indexer.operator.contract.dense_is_exact(*lens, lens[1], params) is exact
    q, k, v = qkv(1, 2, 1, q_len, kv_len, 8, q_len + kv_len, device=device)
    idx, seq_len = (host(t, device) for t in stem_indexer.stem_indexer(
        *stem_indexer.stem_inputs(q, k, v, **SMALL), **SMALL))
    qmax, kmax = -(-q_len // 16), -(-kv_len // 16)
    listed = torch.zeros(1, 2, qmax, kmax + 1, dtype=torch.bool)
    listed.scatter_(-1, torch.where(idx >= 0, idx, kmax).long(), True)
    reach = _reachable(q_len, kv_len, 16, qmax, kmax)
    assert bool((listed[..., :kmax] | ~reach).all()) is exact  # every reached block listed
    _, info = stem_attention(q, k, v, return_info=True, dense_above=1.0, **SMALL)
    assert (info.path == "dense") is exact
    if exact:  # the rule alone sends the call to dense attention
        monkeypatch.setattr(stem_indexer.operator.contract, "dense_is_exact", lambda *args: False)
        stem_indexer.pipeline.plan.cached_plan.cache_clear()  # the call above kept its plan
        out, info = stem_attention(q, k, v, return_info=True, dense_above=1.0, **SMALL)
        assert info.path == "sparse"
        dense = dense_attention(q, k, v)
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
