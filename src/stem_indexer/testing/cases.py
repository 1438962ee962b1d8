"""The numbered case table shared by the tests, the CLI and the benchmarks.

Ids follow the reference test suite: ``SI_WB_001`` .. ``SI_WB_100`` rank in
float32 (``topk_score_precision=1``); ``SI_WB_1xx`` is ``SI_WB_0xx`` mirrored
with bfloat16 ranking (``topk_score_precision=2``), for every base case.
The table is append-only: never renumber or change a case, add a new one.

Each case says what it covers. Shapes are sized for a 2-core CPU (few heads,
small Df) while the sequence lengths, block counts and budgets are real,
including kv at 32K .. 1M tokens. Cases marked ``large`` run only on request
(``pytest --run-large``, ``stem-indexer verify --large``).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch

from ..operator.contract import IndexerParams, ceil_div

__all__ = ["Case", "CASES", "GRAPH_SUBSET", "all_cases", "get_case", "select_cases",
           "graph_subset"]

MIRROR_OFFSET = 100


@dataclass(frozen=True)
class Case:
    """One test case: shapes, lengths, attributes and how to draw the data."""

    number: int
    covers: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    q_heads: int = 4
    kv_heads: int = 2
    dim: int = 64  # Df
    prompt_lens: tuple[int, ...] | None = None
    q_blocks: int | None = None  # Qmax; default: enough for the longest query
    kv_blocks: int | None = None  # Kmax; default: enough for the longest kv
    params: IndexerParams = field(default_factory=IndexerParams)
    # "randn": bf16 normal Q/K, vbias ~ vbias_scale * normal;
    # "integer": small-integer Q/K and vbias on a 1/64 grid, so that every
    #   score is exact in float32 whatever the summation order (many ties).
    data: str = "randn"
    vbias_scale: float = 0.1
    seed: int = 0
    large: bool = False

    @property
    def id(self) -> str:
        return f"SI_WB_{self.number:03d}"

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def label(self) -> str:
        """A readable test id, e.g. ``SI_WB_007-B3-Nq4-Nk2-q512-kv4096-causal-p1``."""
        p = self.params
        q = max(self.q_lens) if self.q_lens else 0
        kv = max(self.kv_lens) if self.kv_lens else 0
        mode = "causal" if p.causal else "full"
        return (f"{self.id}-B{self.batch}-Nq{self.q_heads}-Nk{self.kv_heads}-q{q}-kv{kv}"
                f"-bs{p.stem_block_size}-{mode}-p{p.topk_score_precision}")

    @property
    def shape_q_blocks(self) -> int:
        bs = self.params.stem_block_size
        return self.q_blocks or max(1, max(ceil_div(x, bs) for x in self.q_lens))

    @property
    def shape_kv_blocks(self) -> int:
        bs = self.params.stem_block_size
        return self.kv_blocks or max(1, max(ceil_div(x, bs) for x in self.kv_lens))

    def mirrored(self) -> "Case":
        """The same case ranked in bfloat16 (``topk_score_precision=2``)."""
        return dataclasses.replace(
            self, number=self.number + MIRROR_OFFSET,
            covers=f"{self.covers} [bf16 ranking mirror of {self.id}]",
            params=dataclasses.replace(self.params, topk_score_precision=2))

    def op_kwargs(self) -> dict:
        """The op's scalar attributes, as keyword arguments."""
        return dataclasses.asdict(self.params)

    def make_inputs(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Deterministic input tensors for this case."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.number % MIRROR_OFFSET)
        b, nq, nk, df = self.batch, self.q_heads, self.kv_heads, self.dim
        qmax, kmax = self.shape_q_blocks, self.shape_kv_blocks
        if self.data == "integer":
            qflat = torch.randint(-3, 4, (b, nq, qmax, df), generator=gen).to(torch.bfloat16)
            kflat = torch.randint(-3, 4, (b, nk, kmax, df), generator=gen).to(torch.bfloat16)
            vbias = torch.randint(-64, 65, (b, nk, kmax), generator=gen).float() / 64
        elif self.data == "randn":
            qflat = torch.randn((b, nq, qmax, df), generator=gen).to(torch.bfloat16)
            kflat = torch.randn((b, nk, kmax, df), generator=gen).to(torch.bfloat16)
            vbias = torch.randn((b, nk, kmax), generator=gen) * self.vbias_scale
        else:
            raise ValueError(f"unknown data kind {self.data!r}")
        i32 = dict(dtype=torch.int32)
        inputs = {
            "qflat": qflat, "kflat": kflat, "vbias": vbias,
            "q_seq_lens": torch.tensor(self.q_lens, **i32),
            "kv_seq_lens": torch.tensor(self.kv_lens, **i32),
            "num_prompt_tokens": (None if self.prompt_lens is None
                                  else torch.tensor(self.prompt_lens, **i32)),
        }
        return {k: (v.to(device) if v is not None else None) for k, v in inputs.items()}


def _p(**kw) -> IndexerParams:
    return IndexerParams(**kw)


_BS = 128  # the NPU's stem_block_size; most cases use it, so lengths read as n * _BS


def _mixed(batch: int, seed: int, *, bs: int = _BS, max_kv: int = 150, max_q: int = 6,
           prompts: bool = False, empties: bool = False):
    """Deterministic varied lengths for a mixed batch: ``(q_lens, kv_lens, prompt_lens)``.

    Batches cycle through single-token decode (q=1), multi-token decode inside
    one block, a prefill chunk at the end of the kv, a full prefill (q == kv)
    and, with ``empties``, q=0 and kv=0 batches. kv lengths are uniform in
    [1, max_kv blocks] (tails included); prefills have at most ``max_q`` blocks.
    With ``prompts`` every prompt is its kv plus up to 40 blocks. Only
    ``random.Random.random`` is used: its stream is stable across Python versions.
    """
    rng = random.Random(seed)

    def draw(lo: int, hi: int) -> int:
        return lo + int(rng.random() * (hi - lo + 1))

    kinds = ["decode", "chunk", "short", "full"] + (["empty_q", "empty_kv"] if empties else [])
    q_lens, kv_lens, prompt_lens = [], [], []
    for b in range(batch):
        kind = kinds[(b + seed) % len(kinds)]
        kv = draw(1, max_kv * bs)
        if kind == "decode":
            q = 1
        elif kind == "short":
            q = min(kv, draw(2, max(bs - 1, 2)))
        elif kind == "chunk":
            q = min(kv, draw(1, max_q * bs))
        elif kind == "full":
            kv = q = draw(1, max_q * bs)
        elif kind == "empty_q":
            q = 0
        else:  # empty_kv
            q, kv = draw(1, 2 * bs), 0
        q_lens.append(q)
        kv_lens.append(kv)
        prompt_lens.append(kv + draw(0, 40 * bs))
    return tuple(q_lens), tuple(kv_lens), (tuple(prompt_lens) if prompts else None)


def _mixed_case(number: int, covers: str, batch: int, *, mix: dict | None = None, **kw) -> Case:
    q, kv, prompt = _mixed(batch, number, **(mix or {}))
    return Case(number, covers, q_lens=q, kv_lens=kv, prompt_lens=prompt, **kw)


# --------------------------------------------------------------------------- #
# The table. Base cases are numbered 1..100; each has a mirror at +100.
#
# Conventions in ``covers``: Qb/Kb are a batch's query/key block counts, P its
# prompt blocks, Ks the branch budget, K a row's budget, s2 its visible key
# blocks, "row i" a query block. Unless a case says otherwise the attributes
# are the schema defaults (Bs=128, Ts=16 so the score scale is 1/64,
# initial_blocks = window_size = 4, rates 0.2/0.1, biases 30, alpha 1).
# Forced blocks number 8 once s2 >= 8, so a causal row "binds" (drops
# candidates) when s2 > 8 + K. With P < 56, Ks = P >= Kb and nothing binds.
#
# Batch sizes: the reference covers 1..19, 23..31, 37 and 39. Each case has
# one batch size; together they cover all of these (a test checks it).
# --------------------------------------------------------------------------- #

_BASE: list[Case] = [
    Case(1, "article example scaled down: B=4, Nq=64, Nk=8, 16 q blocks, 64 kv blocks",
         q_lens=(2048,) * 4, kv_lens=(8192,) * 4, q_heads=64, kv_heads=8, dim=32),
    Case(2, "q and kv tail blocks (lengths not multiples of the block size)",
         q_lens=(1000, 333), kv_lens=(5000, 4097)),
    Case(3, "exact integer scores with many ties: tie-break to the lower block index "
            "(prompts of 313/235 blocks with rate 0, bias 5: K = 5 of up to 40 candidates)",
         q_lens=(1024, 512), kv_lens=(6144, 4096), prompt_lens=(40000, 30000), data="integer",
         params=_p(k_block_num_rate_large=0.0, k_block_num_bias_large=5)),

    # ---- tails, empty batches, padding ------------------------------------ #
    Case(4, "q and kv tail blocks, causal: q=1 (one token), 511 (3 blocks + 127), 129 (1 block "
            "+ 1); kv=1153 (9 blocks + 1), 64 (half a block), 5119 (40 blocks - 1); batch 1 has "
            "q (4 blocks) longer than kv (1 block): its rows 0-2 are empty, row 3 has s2=1",
         q_lens=(1, 3 * _BS + 127, _BS + 1), kv_lens=(9 * _BS + 1, 64, 40 * _BS - 1)),
    Case(5, "non-causal twin of SI_WB_004: every live row sees all Kb blocks, tails included",
         q_lens=(1, 3 * _BS + 127, _BS + 1), kv_lens=(9 * _BS + 1, 64, 40 * _BS - 1),
         params=_p(causal=False)),
    Case(6, "q_seq_lens=0 batches (0 and 2) between live batches, causal; their rows stay "
            "empty while their kv is non-empty",
         q_lens=(0, 5 * _BS, 0, 1), kv_lens=(32 * _BS, 3000, _BS + 1, 5000)),
    Case(7, "kv_seq_lens=0 batches (0 and 2) with live queries between live batches, causal: "
            "their rows must stay empty",
         q_lens=(4 * _BS, 2 * _BS, 1, 3 * _BS), kv_lens=(0, 16 * _BS, 0, 4000)),
    Case(8, "q=0 and kv=0 together (batches 0, 1, 3) mixed with live batches, non-causal; "
            "Qmax=12 and Kmax=64 exceed what any batch needs (padded rows empty, padded "
            "key blocks hold random data that must never be picked)",
         q_lens=(0, 0, 1000, 0, 300), kv_lens=(0, 0, 7000, 0, 900), q_blocks=12, kv_blocks=64,
         params=_p(causal=False)),
    Case(9, "no live row at all (q=0 or kv=0 in every batch): outputs all -1 / 0, empty plan",
         q_lens=(0, _BS, 0), kv_lens=(0, 0, 5 * _BS)),
    Case(10, "padding with binding budget: Qmax=20, Kmax=90 beyond every batch; "
             "num_prompt_tokens > kv (P=100, Ks=50 and P=72, Ks=44); batch 1 rows see "
             "69-71 blocks and drop candidates, padded key blocks must never be picked",
         q_lens=(1000, 300), kv_lens=(7000, 9000), prompt_lens=(100 * _BS, 9100),
         q_blocks=20, kv_blocks=90),

    # ---- sink / window overlap --------------------------------------------- #
    Case(11, "sink/window overlap on a causal prefill q=kv=10 blocks (P=10, all visible kept): "
             "rows 0-2 s2=1..3 (sink and window clipped to s2), row 3 s2=4 (full overlap), "
             "rows 4-6 s2=5..7 (partial; row 6 s2=7 shares block 3), row 7 s2=8 (touching), "
             "rows 8-9 disjoint with 1-2 candidates",
         q_lens=(10 * _BS,), kv_lens=(10 * _BS,)),
    Case(12, "overlap with a binding budget: Ks=1 (rate_large=0, bias_large=1, prompt 200 "
             "blocks), causal q=kv=16 blocks: rows 0-7 forced only (s2=1..8, clipped/full/"
             "partial overlap), row 8 s2=9 == forced+budget exactly, row 9 s2=10 one past, "
             "rows 10-15 pick 1 of 3..8 candidates",
         q_lens=(16 * _BS,), kv_lens=(16 * _BS,), prompt_lens=(200 * _BS,),
         params=_p(k_block_num_rate_large=0.0, k_block_num_bias_large=1)),
    Case(13, "non-causal overlap per batch: Kb=3 (clipped), 4 (full overlap), 7 (partial), "
             "8 (touching), 11 (3 candidates); Ks=2 (P=100, rate_medium=0, bias_medium=2) and "
             "alpha=0.5 decays it to 1 from pos 3; batch 2 has q (9 blocks) longer than kv (7): "
             "pos = i-2 is negative on its rows 0-1",
         q_lens=(2 * _BS, 1, 9 * _BS, _BS, 300), kv_lens=(384, 4 * _BS, 800, 8 * _BS, 1300),
         prompt_lens=(100 * _BS,) * 5,
         params=_p(causal=False, alpha=0.5, k_block_num_rate_medium=0.0,
                   k_block_num_bias_medium=2)),

    # ---- causal / non-causal, q vs kv ------------------------------------- #
    Case(14, "causal, q longer than kv: q=16 over kv=8 blocks (rows 0-7 see nothing, rows 8-15 "
             "s2=1..8) and q=8 over kv=3 blocks (rows 0-4 empty); early rows see few blocks",
         q_lens=(16 * _BS, 1000), kv_lens=(8 * _BS, 300)),
    Case(15, "causal, q longer than kv with a binding decaying budget: q=80, kv=P=70 blocks "
             "(Ks=44), alpha=0.5: rows 0-9 empty, row i sees i-9 blocks at pos i-10; "
             "K decays 44 -> 22",
         q_lens=(80 * _BS,), kv_lens=(70 * _BS,), params=_p(alpha=0.5)),
    Case(16, "non-causal, q longer than kv (lengths of SI_WB_015): every row sees 70 blocks; "
             "pos = i-10 < 0 on rows 0-9 (K=Ks=44), K decays on rows 54-79",
         q_lens=(80 * _BS,), kv_lens=(70 * _BS,), params=_p(causal=False, alpha=0.5)),
    Case(17, "non-causal prefill q=kv=P=100 blocks (Ks=50), alpha=0.5: s2=100 on every row "
             "while K decays with the row position (50 at row 50 -> 25 at row 99)",
         q_lens=(100 * _BS,), kv_lens=(100 * _BS,), params=_p(causal=False, alpha=0.5)),
    Case(18, "causal chunked prefill: a 6-block chunk at the end of a 300-block kv with prompt "
             "320 blocks (Ks=62), and 2 blocks (200 tokens) at the end of 57 blocks (P=57, Ks=41)",
         q_lens=(6 * _BS, 200), kv_lens=(300 * _BS, 57 * _BS - 3),
         prompt_lens=(320 * _BS, 57 * _BS)),

    # ---- TPD alpha ----------------------------------------------------------- #
    Case(19, "alpha=1 (no decay), medium branch: causal q=kv=P=100 blocks (Ks=50), K=50 on "
             "every row; row 57 (s2=58) is forced+budget exactly, row 58 one past",
         q_lens=(100 * _BS,), kv_lens=(100 * _BS,), dim=32),
    Case(20, "alpha=0.5, medium branch: causal q=kv=P=100 blocks, K decays 50 (row 50) -> 25 "
             "(row 99); row 54 (s2=55, K=47) is forced+budget exactly, row 55 one past",
         q_lens=(100 * _BS,), kv_lens=(100 * _BS,), dim=32, params=_p(alpha=0.5)),
    Case(21, "alpha=0.01 (strong decay), medium branch: causal q=kv=P=100 blocks, K decays "
             "50 -> clamp at 1 on rows 98-99; row 53 (s2=54) is forced+budget exactly",
         q_lens=(100 * _BS,), kv_lens=(100 * _BS,), dim=32, params=_p(alpha=0.01)),
    Case(22, "alpha=0.5, large branch: causal q=kv=P=400 blocks (Ks=70) decays to 35; row 76 "
             "(s2=77) is forced+budget exactly, row 77 one past; multi-tile plan (> 64 rows)",
         q_lens=(400 * _BS,), kv_lens=(400 * _BS,), q_heads=2, kv_heads=1, dim=16,
         params=_p(alpha=0.5)),
    Case(23, "alpha=0.01, large branch: 64-block chunk at the end of kv=P=600 blocks (Ks=90); "
             "pos 536..599 has K 11 -> clamp 1 (rows 57-63)",
         q_lens=(64 * _BS,), kv_lens=(600 * _BS,), q_heads=2, kv_heads=1, dim=16,
         params=_p(alpha=0.01)),
    Case(24, "float32 roundings of the TPD interpolation, alpha=0.01: P=102 pos 84 (batch 0 "
             "row 6) has K=16 only with the fused t*d+ks (two roundings give 17); P=93 pos 73 "
             "(batch 1 row 4) has K=21 (float64 math gives 20); both rows bind",
         q_lens=(24 * _BS,) * 2, kv_lens=(102 * _BS, 93 * _BS), params=_p(alpha=0.01)),
    Case(25, "float32 roundings with alpha=0.25, large branch: P=181 pos 169 (b0 row 4, K=14), "
             "P=201 pos 186 (b1 row 1, K=15), P=254 pos 223 and 247 (b2 rows 1 and 25, K=19 "
             "and 14): fused t*d+ks differs from two roundings on each",
         q_lens=(16 * _BS, 16 * _BS, 32 * _BS), kv_lens=(181 * _BS, 201 * _BS, 254 * _BS),
         q_heads=2, kv_heads=1, dim=16, params=_p(alpha=0.25)),
    _mixed_case(26, "alpha=0.3 over a mixed batch of 13 (decode, chunks, full prefills) with "
                    "prompts longer than kv", 13, mix=dict(prompts=True), params=_p(alpha=0.3)),

    # ---- budget branches and their edges ------------------------------------ #
    Case(27, "P=55/56 edges set by num_prompt_tokens, prompts not divisible by Bs: prompts "
             "6913, 7040 (P=55, Ks=55: all kept) and 7041, 7168 (P=56, Ks=41) over kv=50 "
             "blocks, q=3 blocks causal: rows s2=48, 49 (forced+budget exactly), 50 (one past)",
         q_lens=(3 * _BS,) * 4, kv_lens=(50 * _BS,) * 4, prompt_lens=(6913, 7040, 7041, 7168)),
    Case(28, "P=159/160 edges set by num_prompt_tokens (kv 70 or 55 blocks): prompts 20351, "
             "20352 (P=159, Ks=61: row s2=69 is forced+budget exactly, s2=70 one past), "
             "20353, 20480 (P=160, Ks=46: binds on kv=70; on kv=55, s2=54 exact, s2=55 one past)",
         q_lens=(2 * _BS,) * 6, kv_lens=(70 * _BS,) * 4 + (55 * _BS,) * 2,
         prompt_lens=(20351, 20352, 20353, 20480, 20353, 20480)),
    Case(29, "budget branches with kv at the edges and no num_prompt_tokens: single-token "
             "decode over kv=P=55 (small, all kept), 56 (Ks=41), 159 (Ks=61), 160 (Ks=46) "
             "and 161 blocks minus a tail",
         q_lens=(1,) * 5, kv_lens=(55 * _BS, 56 * _BS, 159 * _BS, 160 * _BS, 161 * _BS - 100)),
    Case(30, "decay <= 1 edge with generalised rates (rate_medium=0.99, bias_medium=0), "
             "alpha=0.01: P=100 gives Ks=99, decay 1 (never decays); P=101 gives Ks=99, decay 2: "
             "K=99 at pos 99 then 1 at pos 100 (batch 1 row 1 binds)",
         q_lens=(2 * _BS,) * 2, kv_lens=(100 * _BS, 101 * _BS),
         params=_p(alpha=0.01, k_block_num_rate_medium=0.99, k_block_num_bias_medium=0)),
    Case(31, "K cap 256: rate_large=1.0, bias_large=100 give Ks=500 for kv=P=400 blocks; "
             "causal q=8 blocks, up to 392 candidates, K=256 binds",
         q_lens=(8 * _BS,), kv_lens=(400 * _BS,), q_heads=2, kv_heads=1, dim=16,
         params=_p(k_block_num_rate_large=1.0, k_block_num_bias_large=100)),
    Case(32, "float32 rounding of the branch budget: f32(90*f32(0.7))=63 (float64: 62.99 -> 62) "
             "with rate_medium=0.7, and f32(180*f32(0.35))=63 with rate_large=0.35, biases 0; "
             "single-token decode so K=63 binds",
         q_lens=(1, 1), kv_lens=(90 * _BS, 180 * _BS),
         params=_p(k_block_num_rate_medium=0.7, k_block_num_bias_medium=0,
                   k_block_num_rate_large=0.35, k_block_num_bias_large=0)),
    Case(33, "rates and biases 0: Ks=0 in the medium (P=100) and large (P=300) branches, so "
             "only sink and window are kept",
         q_lens=(4 * _BS, 1), kv_lens=(100 * _BS, 300 * _BS),
         params=_p(k_block_num_rate_medium=0.0, k_block_num_bias_medium=0,
                   k_block_num_rate_large=0.0, k_block_num_bias_large=0)),

    # ---- GQA: the six NPU pairs and more, over mixed batches --------------- #
    _mixed_case(34, "GQA Nq=32, Nk=2 (group 16) over a mixed batch of 8", 8,
                q_heads=32, kv_heads=2, dim=16),
    _mixed_case(35, "GQA Nq=32, Nk=4 (group 8) over a mixed batch of 11 with q=0/kv=0 batches",
                11, mix=dict(empties=True), q_heads=32, kv_heads=4, dim=16),
    _mixed_case(36, "GQA Nq=32, Nk=8 (group 4) over a mixed batch of 14, non-causal", 14,
                q_heads=32, kv_heads=8, dim=16, params=_p(causal=False)),
    _mixed_case(37, "GQA Nq=64, Nk=2 (group 32) over a mixed batch of 6 with prompts > kv", 6,
                mix=dict(prompts=True), q_heads=64, kv_heads=2, dim=16),
    _mixed_case(38, "GQA Nq=64, Nk=4 (group 16) over a mixed batch of 15, alpha=0.5", 15,
                q_heads=64, kv_heads=4, dim=16, params=_p(alpha=0.5)),
    _mixed_case(39, "GQA Nq=64, Nk=8 (group 8) over a mixed batch of 17", 17,
                mix=dict(max_q=3), q_heads=64, kv_heads=8, dim=16),
    _mixed_case(40, "MHA Nq=Nk=4 over a mixed batch of 18", 18, q_heads=4, kv_heads=4),
    _mixed_case(41, "MQA Nq=8, Nk=1 over a mixed batch of 19", 19, q_heads=8, kv_heads=1,
                dim=32),
    _mixed_case(42, "Nq=12, Nk=3 (heads not powers of two, group 4) over a mixed batch of 16",
                16, q_heads=12, kv_heads=3, dim=16),
    _mixed_case(43, "Nq=15, Nk=5 (group 3) over a mixed batch of 9 with prompts > kv", 9,
                mix=dict(prompts=True), q_heads=15, kv_heads=5, dim=16),
    Case(44, "Nq=Nk=1, B=1: a single head on a causal prefill q=kv=3000 tokens",
         q_lens=(3000,), kv_lens=(3000,), q_heads=1, kv_heads=1),

    # ---- many batches, mixed lengths, prefill + decode --------------------- #
    _mixed_case(45, "mixed prefill/decode batch of 23 with q=0/kv=0 batches", 23,
                mix=dict(empties=True)),
    _mixed_case(46, "mixed batch of 24, non-causal, prompts > kv", 24, mix=dict(prompts=True),
                params=_p(causal=False)),
    _mixed_case(47, "mixed batch of 25, alpha=0.01, prompts > kv", 25, mix=dict(prompts=True),
                params=_p(alpha=0.01)),
    _mixed_case(48, "mixed batch of 26 with short kv (<= 12 blocks, P < 56: all kept)", 26,
                mix=dict(max_kv=12, max_q=4)),
    _mixed_case(49, "mixed batch of 27, Bs=64/Ts=16 (R=4), kv up to 300 blocks", 27,
                mix=dict(bs=64, max_kv=300), params=_p(stem_block_size=64)),
    _mixed_case(50, "mixed batch of 28, Nq=8/Nk=2, alpha=0.5, with q=0/kv=0 batches", 28,
                mix=dict(empties=True), q_heads=8, kv_heads=2, dim=16, params=_p(alpha=0.5)),
    _mixed_case(51, "mixed batch of 29, kv up to 400 blocks (all three branches)", 29,
                mix=dict(max_kv=400, max_q=3), dim=16),
    _mixed_case(52, "mixed batch of 30, non-causal, q=0/kv=0 batches", 30,
                mix=dict(empties=True, max_q=3), params=_p(causal=False)),
    _mixed_case(53, "mixed batch of 31, Bs=32/Ts=4 (R=8), kv up to 600 blocks", 31,
                mix=dict(bs=32, max_kv=600, max_q=4), params=_p(stem_block_size=32, stem_stride=4)),
    _mixed_case(54, "mixed batch of 37 with prompts > kv", 37, mix=dict(prompts=True, max_q=3),
                dim=16),
    _mixed_case(55, "mixed batch of 39, q=0/kv=0 batches, alpha=0.5", 39,
                mix=dict(empties=True, max_q=3), dim=16, params=_p(alpha=0.5)),
    Case(56, "pure single-token decode, B=12: q=1 everywhere, kv from 1 token to 300 blocks, "
             "prompts >= kv (equal on 7 of 12, larger on 5)",
         q_lens=(1,) * 12,
         kv_lens=(1, 127, 129, 4 * _BS, 9 * _BS + 5, 50 * _BS, 56 * _BS, 100 * _BS - 1,
                  159 * _BS, 160 * _BS, 250 * _BS + 3, 300 * _BS),
         prompt_lens=(1, 200, 129, 4 * _BS, 20 * _BS, 50 * _BS, 70 * _BS, 100 * _BS - 1,
                      200 * _BS, 160 * _BS, 400 * _BS, 300 * _BS)),

    # ---- long contexts (few heads, small Df) ------------------------------- #
    Case(57, "long context 32K: kv=P=256 blocks (Ks=55), 4-block chunk at the end",
         q_lens=(4 * _BS,), kv_lens=(32768,), dim=16),
    Case(58, "long context 64K: kv=P=512 blocks (Ks=81), 2-block chunk; second batch 40000 "
             "tokens (tail) with a single-token decode",
         q_lens=(2 * _BS, 1), kv_lens=(65536, 40000), dim=16),
    Case(59, "long context 128K: kv=P=1024 blocks (Ks=132), 8-block chunk, alpha=0.5",
         q_lens=(8 * _BS,), kv_lens=(131072,), dim=16, params=_p(alpha=0.5)),
    Case(60, "long context 256K: kv=P=2048 blocks (Ks=234), 3-block chunk, alpha=0.01",
         q_lens=(3 * _BS,), kv_lens=(262144,), dim=16, params=_p(alpha=0.01)),
    Case(61, "long context 1M: kv=P=8192 blocks (Ks=849, K capped at 256), 2-block chunk",
         q_lens=(2 * _BS,), kv_lens=(1 << 20,), q_heads=2, kv_heads=1, dim=16),
    Case(62, "long-context decode mix: kv=1M (prompt 1M+5000), 512K+77 and 32K with q=1, 1 "
             "and 300 tokens",
         q_lens=(1, 1, 300), kv_lens=(1 << 20, (1 << 19) + 77, 32768),
         prompt_lens=((1 << 20) + 5000, (1 << 19) + 77, 40000), q_heads=2, kv_heads=1, dim=16),
    Case(63, "causal prefill q=kv=128K (1024 x 1024 blocks, Ks=132): every s2 from 1 to 1024; "
             "row 139 (s2=140) is forced+budget exactly, row 140 one past",
         q_lens=(131072,), kv_lens=(131072,), q_heads=2, kv_heads=1, dim=16),
    Case(64, "causal prefill q=kv=32K (256 blocks, Ks=55), alpha=0.5, Nq=4/Nk=2",
         q_lens=(32768,), kv_lens=(32768,), dim=16, params=_p(alpha=0.5)),
    Case(65, "kv of 2.1M tokens (16407 key blocks, more than the fast path's 16384-block key "
             "chunk) with a 2-block chunk: K capped at 256",
         q_lens=(2 * _BS,), kv_lens=(2_100_000,), q_heads=2, kv_heads=1, dim=8),
    Case(66, "1M-token causal prefill q=kv=8192 blocks (Ks=849, K capped at 256)",
         q_lens=(1 << 20,), kv_lens=(1 << 20,), q_heads=2, kv_heads=1, dim=16, large=True),
    Case(67, "512K-token causal prefill, alpha=0.01, Nq=4/Nk=2, B=2 with a 300K second batch",
         q_lens=(1 << 19, 300_000), kv_lens=(1 << 19, 300_000), dim=16,
         params=_p(alpha=0.01), large=True),

    # ---- vbias and the score scale ------------------------------------------ #
    Case(68, "vbias dominates the selection (vbias_scale=5.0): causal q=kv=P=100 blocks",
         q_lens=(100 * _BS,), kv_lens=(100 * _BS,), vbias_scale=5.0),
    Case(69, "vbias all zero (vbias_scale=0): selection by the dot products alone",
         q_lens=(100 * _BS,), kv_lens=(100 * _BS,), vbias_scale=0.0),
    Case(70, "Bs=64, Ts=16 (R=4, scale 1/16): causal prefill q=kv=128 blocks (8192 tokens)",
         q_lens=(8192,), kv_lens=(8192,), params=_p(stem_block_size=64)),
    Case(71, "Bs=48, Ts=16 (R=3, scale f32(1/9) inexact), tails, prompts > kv",
         q_lens=(500, 1, 48 * 20), kv_lens=(48 * 150 - 7, 3000, 48 * 100),
         prompt_lens=(48 * 170, 3000, 48 * 200), params=_p(stem_block_size=48)),
    Case(72, "Bs=16, Ts=16 (R=1, no scaling): causal q=kv=100 blocks (1600 tokens) and "
             "a decode over 300 blocks",
         q_lens=(1600, 1), kv_lens=(1600, 4800), params=_p(stem_block_size=16)),
    Case(73, "Bs=32, Ts=4 (R=8, scale 1/64 with other blocks): chunked prefill",
         q_lens=(10 * 32, 33), kv_lens=(200 * 32, 90 * 32 + 1),
         params=_p(stem_block_size=32, stem_stride=4)),
    Case(74, "Bs=256, Ts=16 (R=16, scale 1/256): causal prefill q=kv=100 blocks",
         q_lens=(100 * 256,), kv_lens=(100 * 256,), params=_p(stem_block_size=256)),
    Case(75, "Bs=1, Ts=1: every token is a block; causal q=kv=120 tokens with prompt 300 "
             "(P=300, Ks=60): rows 68-119 bind",
         q_lens=(120,), kv_lens=(120,), prompt_lens=(300,), params=_p(stem_block_size=1,
                                                                       stem_stride=1)),
    Case(76, "Bs=128, Ts=1 (R=128, scale 1/16384): dot products shrink, vbias dominates",
         q_lens=(4 * _BS,), kv_lens=(100 * _BS,), params=_p(stem_stride=1)),

    # ---- exact integer scores (ties) ---------------------------------------- #
    Case(77, "integer scores, causal prefill q=kv=64 blocks, Nq=8/Nk=2, Df=32",
         q_lens=(64 * _BS,), kv_lens=(64 * _BS,), q_heads=8, kv_heads=2, dim=32,
         data="integer"),
    Case(78, "integer scores with Df=1 (massive ties), non-causal, 4 q blocks over 200 "
             "kv blocks",
         q_lens=(4 * _BS,), kv_lens=(200 * _BS,), dim=1, data="integer",
         params=_p(causal=False)),
    _mixed_case(79, "integer scores, GQA Nq=32/Nk=8, mixed batch of 7", 7, q_heads=32,
                kv_heads=8, dim=8, data="integer"),
    Case(80, "integer scores over a long row: kv=256K (2048 blocks), 2-block chunk, Df=8",
         q_lens=(2 * _BS,), kv_lens=(262144,), dim=8, data="integer"),
    Case(81, "integer scores, Bs=16/Ts=16 (R=1), Df=4, alpha=0.5, prompts > kv",
         q_lens=(300, 17), kv_lens=(2000, 1000), prompt_lens=(2500, 3000), dim=4,
         data="integer", params=_p(stem_block_size=16, alpha=0.5)),
    Case(82, "integer scores, initial_blocks=0, window_size=0 (everything by top-k), "
             "alpha=0.01",
         q_lens=(20 * _BS,), kv_lens=(120 * _BS,), dim=16, data="integer",
         params=_p(initial_blocks=0, window_size=0, alpha=0.01)),
    Case(83, "integer scores, Bs=64/Ts=4 (R=16), non-causal with q (80 blocks) longer than kv "
             "(70 blocks), P=100 (Ks=50): every row drops 12 of 62 candidates",
         q_lens=(80 * 64,), kv_lens=(70 * 64,), prompt_lens=(100 * 64,), dim=16, data="integer",
         params=_p(causal=False, stem_block_size=64, stem_stride=4)),

    # ---- generalised attributes (CONTRACT.md section 4) ---------------------------- #
    Case(84, "initial_blocks=0, window_size=0: no forced blocks, causal q=kv=P=100, alpha=0.5",
         q_lens=(100 * _BS,), kv_lens=(100 * _BS,),
         params=_p(initial_blocks=0, window_size=0, alpha=0.5)),
    Case(85, "initial_blocks=1, window_size=1: causal q=kv=P=64 blocks (Ks=42); row 43 (s2=44) "
             "is forced+budget exactly, row 44 one past",
         q_lens=(64 * _BS,), kv_lens=(64 * _BS,), params=_p(initial_blocks=1, window_size=1)),
    Case(86, "initial_blocks=0, window_size=4 (window only), causal q=kv=P=80 blocks",
         q_lens=(80 * _BS,), kv_lens=(80 * _BS,), params=_p(initial_blocks=0)),
    Case(87, "initial_blocks=4, window_size=0 (sink only), causal q=kv=P=80 blocks, alpha=0.5",
         q_lens=(80 * _BS,), kv_lens=(80 * _BS,), params=_p(window_size=0, alpha=0.5)),
    Case(88, "large initial_blocks=100, window_size=64 (beyond most rows' s2): causal "
             "q=kv=P=180 blocks; only rows with s2 > 164 have candidates",
         q_lens=(180 * _BS,), kv_lens=(180 * _BS,), q_heads=2, kv_heads=1, dim=16,
         params=_p(initial_blocks=100, window_size=64)),
    Case(89, "asymmetric initial_blocks=2, window_size=9 with Bs=32/Ts=8 (R=4)",
         q_lens=(40 * 32, 5), kv_lens=(120 * 32, 77 * 32 + 9),
         params=_p(initial_blocks=2, window_size=9, stem_block_size=32, stem_stride=8)),
    Case(90, "generalised rates/biases: rate_medium=0.35, bias_medium=5, rate_large=0.05, "
             "bias_large=60 over P=80, 150, 170 and 700",
         q_lens=(3 * _BS, 1, 2 * _BS, 1), kv_lens=(80 * _BS, 150 * _BS, 170 * _BS, 700 * _BS),
         dim=16, params=_p(k_block_num_rate_medium=0.35, k_block_num_bias_medium=5,
                           k_block_num_rate_large=0.05, k_block_num_bias_large=60)),
    Case(91, "Df=2048, the NPU's Df (Ts*D = 16*128): 2-block chunk over 64 blocks, Nq=2/Nk=1",
         q_lens=(2 * _BS,), kv_lens=(64 * _BS,), q_heads=2, kv_heads=1, dim=2048),
    Case(92, "Df=1 with random data (bf16 products, frequent ties), causal q=kv=P=70 blocks",
         q_lens=(70 * _BS,), kv_lens=(70 * _BS,), dim=1),
    _mixed_case(93, "Df=257 (odd) over a mixed batch of 10", 10, dim=257),

    # ---- realistic sizes ----------------------------------------------------- #
    Case(94, "the article's example at full size: B=4, Nq=64, Nk=8, Df=2048 (Ts*D = 16*128), "
             "16 q blocks over 64 kv blocks (Ks=42), num_prompt_tokens = kv",
         q_lens=(2048,) * 4, kv_lens=(8192,) * 4, prompt_lens=(8192,) * 4, q_heads=64,
         kv_heads=8, dim=2048),
    Case(95, "GQA prefill at Df=512: Nq=32, Nk=4, causal q=kv=16K (128 blocks, Ks=55)",
         q_lens=(16384,), kv_lens=(16384,), q_heads=32, kv_heads=4, dim=512),
    Case(96, "causal prefill q=kv=64K (512 blocks, Ks=81), Nq=8/Nk=2, Df=128, alpha=0.5",
         q_lens=(65536,), kv_lens=(65536,), q_heads=8, kv_heads=2, dim=128,
         params=_p(alpha=0.5)),
    Case(97, "a serving batch of 8: decode at 1M, 64K and 1 token, 16-block chunked prefills "
             "at 256K and 32K, an 8-block chunk at 128K, full prefills of 2048 and 2000 tokens; "
             "prompts >= kv; Nq=4/Nk=2, Df=128",
         q_lens=(1, 2048, 1024, 1, 2048, 2048, 2000, 1),
         kv_lens=(1 << 20, 1 << 18, 1 << 17, 1 << 16, 1 << 15, 2048, 2000, 1),
         prompt_lens=((1 << 20) + 4096, 1 << 18, (1 << 17) + 100, 1 << 16, 1 << 15, 2048,
                      2000, 1),
         dim=128),
    Case(98, "non-causal long context: 16 q blocks over kv=P=256K (2048 blocks, Ks=234), "
             "alpha=0.5; every row sees all 2048 blocks",
         q_lens=(16 * _BS,), kv_lens=(262144,), dim=32, params=_p(causal=False, alpha=0.5)),
]

CASES: list[Case] = _BASE + [c.mirrored() for c in _BASE]


# A representative subset for graph mode (torch.compile) in the default test
# run: both precisions, causal and non-causal, empty batches and padding, the
# TPD and budget edges, GQA, mixed batches, generalised attributes, 1M kv.
GRAPH_SUBSET: tuple[str, ...] = (
    "SI_WB_002", "SI_WB_103", "SI_WB_005", "SI_WB_108", "SI_WB_009", "SI_WB_113",
    "SI_WB_021", "SI_WB_128", "SI_WB_045", "SI_WB_137", "SI_WB_061", "SI_WB_163",
    "SI_WB_072", "SI_WB_182",
)


def graph_subset() -> list[Case]:
    """The cases of ``GRAPH_SUBSET``."""
    return [get_case(i) for i in GRAPH_SUBSET]


def all_cases(include_large: bool = False) -> list[Case]:
    """Every case in id order; large ones only when asked for."""
    return sorted((c for c in CASES if include_large or not c.large), key=lambda c: c.number)


def get_case(case_id: str) -> Case:
    """The case with id ``SI_WB_nnn`` (``nnn`` alone is accepted too)."""
    wanted = case_id.strip().upper()
    for c in CASES:
        if wanted in (c.id, f"{c.number:03d}", str(c.number)):
            return c
    raise KeyError(f"no case {case_id!r}; ids run {CASES[0].id} .. {CASES[-1].id}")


def select_cases(spec: str | None, include_large: bool = False) -> list[Case]:
    """Cases named by a comma-separated id list (e.g. STEM_INDEXER_CASE_ID), or all.

    Cases named explicitly run even when large.
    """
    if not spec or not spec.strip():
        return all_cases(include_large)
    return [get_case(part) for part in spec.split(",") if part.strip()]
