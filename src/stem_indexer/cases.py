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
from dataclasses import dataclass, field

import torch

from .contract import IndexerParams, ceil_div

__all__ = ["Case", "CASES", "all_cases", "get_case", "select_cases"]

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


# --------------------------------------------------------------------------- #
# The table. Base cases are numbered 1..100; each has a mirror at +100.
# --------------------------------------------------------------------------- #

_BASE: list[Case] = [
    Case(1, "article example scaled down: B=4, Nq=64, Nk=8, 16 q blocks, 64 kv blocks",
         q_lens=(2048,) * 4, kv_lens=(8192,) * 4, q_heads=64, kv_heads=8, dim=32),
    Case(2, "q and kv tail blocks (lengths not multiples of the block size)",
         q_lens=(1000, 333), kv_lens=(5000, 4097)),
    Case(3, "exact integer scores with many ties: tie-break to the lower block index",
         q_lens=(1024, 512), kv_lens=(6144, 4096), data="integer"),
]

CASES: list[Case] = _BASE + [c.mirrored() for c in _BASE]


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
