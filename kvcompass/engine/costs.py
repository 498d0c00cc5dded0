"""The simulated worker's time costs: prefill, DRAM reload and continuous-batching decode, for
Llama-3.1-8B in BF16, with every constant cited.

Sources (all under ``../shared/``): the KVCompass paper (``paper/``), docs/design.md section 6, and
the third-party measurements in ``data/calibration/`` (its README says where each comes from):
the Vidur per-operator profile of Llama-3-8B on A100 (``vidur_llama3_8b_a100_mlp_profile.csv``)
and the published vLLM CI figures (``llama31_8b_published_points.csv``).

**Prefill** is linear in the tokens that must be computed: ``prefill_ms(n) = base + beta * n``
(base 0 by default), the model the paper's score uses (section 3.4), so what the simulator
charges is what the router estimates. Attention's quadratic part is not modelled.

**Reload** of a DRAM-resident prefix into VRAM: ``gamma * n``.

**Decode** (one step of continuous batching, every running sequence emits one token)::

    decode_step_ms(B, C) = max(t0 + a * B, c * B) + b * C

``B`` sequences in the batch, ``C`` the sum of their context lengths (tokens whose KV the step
reads). ``t0 + a * B``: a small step is bound by reading the weights once, plus a little work
per sequence (Vidur's A100 non-attention iteration time over 1..128 tokens fits
9.71 + 0.0291 B ms). ``c * B``: a large step is compute bound at the linear layers' per-token
prefill cost (the two meet near B = 260 on A100; real batches mixing prefill chunks sit on this
branch). ``b * C``: attention reads each context token's KV once per step, ``b`` = KV bytes per
token / HBM bandwidth (a lower bound; decode attention kernels run close to it at long
contexts). The form is ours, fitted to the calibration data; :func:`fit_vidur_profile`
re-derives ``t0``, ``a`` and ``c`` from the profile when it is present.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

from kvcompass import _core

__all__ = [
    "CostModel",
    "LinearFit",
    "PRESETS",
    "VidurFit",
    "find_calibration_file",
    "fit_line",
    "fit_vidur_profile",
    "kv_capacity_tokens",
    "load_vidur_profile",
    "preset",
]

# ---- calibration constants ------------------------------------------------------------------

KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
"""Llama-3.1-8B BF16: K and V x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB
(docs/design.md section 6; calibration README, "First-principles checks")."""

PAPER_PREFILL_MS_PER_TOKEN = 0.085
"""Prefill beta of the paper's RTX 5090 testbed (paper section 5.2: "the calibrated RTX 5090
prefill speed of 0.085 ms/token")."""

A100_PREFILL_MS_PER_TOKEN = 0.066
"""A100 non-attention prefill slope above ~1k tokens per iteration (calibration README, "Derived
from the Vidur profile": "linear at ~0.066 ms/token", about 68 % MFU); attention is not in the
profile. The README's first-principles range for the whole prefill is 0.07-0.10."""

H100_PREFILL_MS_PER_TOKEN = 0.030
"""H100 (and H200: the same GH100 compute die) prefill, the middle of the calibration README's
first-principles range 0.025-0.035 ms/token (16 GFLOP/token at 50-70 % of dense BF16 peak). No
BF16 prefill measurement of Llama-3.1-8B on H100 is in the calibration data."""

PCIE4_BYTES_PER_S = 25e9
"""Host-to-device copy over PCIe 4.0 x16, ~25 GB/s achieved (docs/design.md section 6)."""

RELOAD_MS_PER_TOKEN = 0.005
"""DRAM reload gamma: 128 KiB/token over ~25 GB/s = 0.0052 ms, rounded as docs/design.md section 6
gives it (~0.005) and as the edge's score charges it (EdgeParams.gamma_ms_per_token), so the
simulated cost and the router's estimate agree. Hosts with PCIe 5.0 (H100/H200 SXM) would halve it."""

VIDUR_DECODE_BASE_MS = 9.71
VIDUR_DECODE_MS_PER_SEQ = 0.0291
"""A100 decode step without attention: least squares over the Vidur profile's TP1 rows with
1 <= num_tokens <= 128 (iteration = 32 x per-layer op medians + embedding, the calibration
README's formula; its table reads 9.70 ms at 1 token, 13.19 ms at 128). Attention and the LM
head are not included (:func:`fit_vidur_profile` recomputes both numbers)."""

HBM_BYTES_PER_S = {"a100": 2.04e12, "h100": 3.35e12, "h200": 4.8e12}
"""HBM bandwidth used by the calibration README's decode lower bounds (A100-80GB 2.04 TB/s,
H100 SXM 3.35 TB/s, H200 4.8 TB/s)."""

VLLM_CI_STEP_MS = {"a100": 1585.43 / 128, "h100": 997.54 / 128, "h200": 833.42 / 128}
"""vLLM CI latency test (Llama-3.1-8B, TP1, batch 8, input 32, output 128): mean end-to-end ms
over 128 steps (calibration README, "Published Llama-3.1-8B points"; source ids vllm_ci_a100,
vllm_ci_h100, vllm_ci_h200). Includes prefill, LM head, sampling and scheduling."""
VLLM_CI_BATCH = 8
VLLM_CI_CONTEXT = VLLM_CI_BATCH * (32 + 128 // 2)
"""Mean total context of that test's steps: 8 sequences x (32 prompt + 64 generated on average)."""


@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-worker time costs in ms (see the module notes for the forms and sources).

    The defaults are the paper's testbed (prefill beta 0.085 ms/token on RTX 5090) with A100
    decode figures: the paper reports no decode rate for the RTX 5090, and its large-scale
    simulation calibrates decode against A100 benchmarks (paper section 5.3). Override any field
    by keyword or with :func:`dataclasses.replace`; :func:`preset` gives whole GPU profiles.
    """

    prefill_ms_per_token: float = PAPER_PREFILL_MS_PER_TOKEN
    """beta: ms per uncached prompt token."""
    prefill_base_ms: float = 0.0
    """Fixed cost of a prefill that computes at least one token (0: the paper's linear model)."""
    reload_ms_per_token: float = RELOAD_MS_PER_TOKEN
    """gamma: ms per DRAM-resident prefix token reloaded into VRAM."""
    decode_base_ms: float = VIDUR_DECODE_BASE_MS
    """t0: the weights-bound floor of a decode step."""
    decode_ms_per_seq: float = VIDUR_DECODE_MS_PER_SEQ
    """a: added per sequence in the step while it is weights bound."""
    decode_compute_ms_per_token: float = A100_PREFILL_MS_PER_TOKEN
    """c: per token once the step is compute bound (the linear layers' prefill slope)."""
    decode_ms_per_context_token: float = KV_BYTES_PER_TOKEN / HBM_BYTES_PER_S["a100"] * 1e3
    """b: per context token the step's attention reads (KV bytes / HBM bandwidth)."""
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
    name: str = "paper"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name == "name":
                continue
            x = getattr(self, f.name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise ValueError(f"CostModel.{f.name} = {x!r}: must be a finite number >= 0")
        if self.kv_bytes_per_token <= 0 or not isinstance(self.kv_bytes_per_token, int):
            raise ValueError(f"CostModel.kv_bytes_per_token = {self.kv_bytes_per_token!r}: must be a positive int")

    # The forms live in Rust (``rust/sim/engine.rs``, ``Cost``), where the simulator's engine
    # runs them; these methods are the same code for the services' emulated workers, so a
    # timing rule exists once.

    @property
    def core_args(self) -> tuple[float, float, float, float, float, float, float, int]:
        """The model's figures in the order ``kvcompass._core`` takes them."""
        return (
            self.prefill_ms_per_token,
            self.prefill_base_ms,
            self.reload_ms_per_token,
            self.decode_base_ms,
            self.decode_ms_per_seq,
            self.decode_compute_ms_per_token,
            self.decode_ms_per_context_token,
            self.kv_bytes_per_token,
        )

    def prefill_ms(self, uncached_tokens: int) -> float:
        """Time to prefill ``uncached_tokens`` (0 when nothing needs computing)."""
        return _core.cost_prefill_ms(self.core_args, _count("uncached_tokens", uncached_tokens))

    def reload_ms(self, dram_tokens: int) -> float:
        """Time to reload ``dram_tokens`` of cached KV from host DRAM into VRAM."""
        return _core.cost_reload_ms(self.core_args, _count("dram_tokens", dram_tokens))

    def decode_step_ms(self, batch_size: int, context_tokens: int) -> float:
        """One decode step of ``batch_size`` sequences holding ``context_tokens`` in total
        (0 for an empty batch): ``max(t0 + a * B, c * B) + b * context``."""
        return _core.cost_decode_step_ms(self.core_args, _count("batch_size", batch_size), _count("context_tokens", context_tokens))

    def estimate_ms(self, length: int, vram_hit: int, dram_hit: int, *, batch: int = 0, context: int = 0, max_batched_tokens: int = 2048, chunked: bool = True) -> float:
        """A worker's estimate of a waiting prompt's prefill (what its queue reports): the uncached
        part computed and the DRAM part reloaded and, with chunked sharing, one decode step of
        the batch it runs now (``batch`` sequences of ``context`` tokens) per chunk."""
        return _core.cost_estimate_ms(
            self.core_args,
            _count("length", length),
            _count("vram_hit", vram_hit),
            _count("dram_hit", dram_hit),
            _count("batch", batch),
            _count("context", context),
            _count("max_batched_tokens", max_batched_tokens),
            bool(chunked),
        )

    def chunk_step(self, left: int, extra_ms: float, batch: int, context: int, max_batched_tokens: int = 2048) -> tuple[int, float, float]:
        """One vLLM step under chunked sharing with ``left`` prompt tokens to compute (``extra_ms``
        of fixed cost and reload paid with the first chunk): ``(chunk tokens, the chunk's compute
        ms, the decode step ms)``; the step takes their sum."""
        return _core.cost_chunk_step(self.core_args, _count("left", left), float(extra_ms), _count("batch", batch), _count("context", context), _count("max_batched_tokens", max_batched_tokens))

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of KV cache that ``tokens`` occupy."""
        return self.kv_bytes_per_token * _count("tokens", tokens)


def kv_capacity_tokens(capacity_bytes: int, block_size: int, kv_bytes_per_token: int = KV_BYTES_PER_TOKEN) -> int:
    """Tokens of KV a memory of ``capacity_bytes`` holds, rounded down to whole blocks (what
    :class:`~kvcompass.engine.cache.PrefixCache` takes). Paper section 5.3 gives each worker 32 GB
    of VRAM and 128 GB of DRAM for KV."""
    if block_size < 1 or kv_bytes_per_token < 1:
        raise ValueError("block_size and kv_bytes_per_token must be >= 1")
    blocks = _count("capacity_bytes", capacity_bytes) // (kv_bytes_per_token * block_size)
    return blocks * block_size


def _count(name: str, n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    return n


# ---- presets --------------------------------------------------------------------------------


def _gh100(gpu: str) -> CostModel:
    # No per-batch decode data for H100/H200: scale the A100 per-sequence slope by the prefill
    # (compute) ratio, and put the rest of vLLM CI's measured step into the floor t0.
    a = VIDUR_DECODE_MS_PER_SEQ * H100_PREFILL_MS_PER_TOKEN / A100_PREFILL_MS_PER_TOKEN
    b = KV_BYTES_PER_TOKEN / HBM_BYTES_PER_S[gpu] * 1e3
    t0 = VLLM_CI_STEP_MS[gpu] - a * VLLM_CI_BATCH - b * VLLM_CI_CONTEXT
    return CostModel(
        prefill_ms_per_token=H100_PREFILL_MS_PER_TOKEN,
        decode_base_ms=t0,
        decode_ms_per_seq=a,
        decode_compute_ms_per_token=H100_PREFILL_MS_PER_TOKEN,
        decode_ms_per_context_token=b,
        name=gpu,
    )


PRESETS: dict[str, CostModel] = {
    "paper": CostModel(),
    # A100 from the Vidur profile throughout. vLLM CI measures 12.4 ms/step at batch 8 on A100,
    # 24 % above this model's 10.0 ms: the profile leaves out the LM head, sampling and the
    # scheduler. The H100/H200 presets are anchored on vLLM CI and so include them.
    "a100": CostModel(prefill_ms_per_token=A100_PREFILL_MS_PER_TOKEN, name="a100"),
    "h100": _gh100("h100"),
    "h200": _gh100("h200"),
}
"""Whole GPU profiles for Llama-3.1-8B BF16, TP1: ``paper`` (the default), ``a100``, ``h100``,
``h200``."""


def preset(name: str) -> CostModel:
    """The :data:`PRESETS` entry ``name``; ValueError naming the choices otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cost preset {name!r} (choices: {', '.join(PRESETS)})") from None


# ---- the Vidur profile ----------------------------------------------------------------------

VIDUR_FILE = "vidur_llama3_8b_a100_mlp_profile.csv"
_VIDUR_LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
_VIDUR_LAYERS = 32
_PACKAGE = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class LinearFit:
    """``ms = intercept_ms + slope_ms_per_token * tokens``, least squares over ``points`` rows."""

    intercept_ms: float
    slope_ms_per_token: float
    points: int


@dataclass(frozen=True, slots=True)
class VidurFit:
    """Fits of the Vidur A100 profile: ``prefill`` over num_tokens >= 1024 (compute bound),
    ``decode`` over num_tokens <= 128 (weights bound)."""

    prefill: LinearFit
    decode: LinearFit

    def cost_model(self, base: CostModel | None = None) -> CostModel:
        """``base`` (default: the ``a100`` preset) with prefill beta, c, t0 and a from the fits."""
        return dataclasses.replace(
            PRESETS["a100"] if base is None else base,
            prefill_ms_per_token=self.prefill.slope_ms_per_token,
            decode_compute_ms_per_token=self.prefill.slope_ms_per_token,
            decode_base_ms=self.decode.intercept_ms,
            decode_ms_per_seq=self.decode.slope_ms_per_token,
        )


def find_calibration_file(name: str) -> Path | None:
    """``calibration/<name>`` under ``$KVCOMPASS_DATA``, ``<cwd>/../shared/data`` or
    ``<repo>/../shared/data`` (the same search the RTT matrix uses); None if none has it."""
    roots: list[Path] = []
    env = os.environ.get("KVCOMPASS_DATA")
    if env:
        roots.append(Path(env))
    roots += [Path.cwd() / ".." / "shared" / "data", _PACKAGE.parent.parent / "shared" / "data"]
    for r in roots:
        p = r / "calibration" / name
        if p.is_file():
            return p.resolve()
    return None


def load_vidur_profile(path: str | os.PathLike[str] | None = None, *, tp: int = 1) -> list[tuple[int, float]] | None:
    """``(num_tokens, iteration ms)`` for every row of tensor-parallel degree ``tp``, sorted;
    iteration = 32 x (sum of the per-layer op medians) + embedding median, the calibration
    README's formula (attention and the LM head are not in the profile). ``path`` None: the
    shared file if :func:`find_calibration_file` finds it, else None. ValueError if the file
    lacks a needed column or holds a value that is not a number."""
    p = find_calibration_file(VIDUR_FILE) if path is None else Path(path)
    if p is None:
        return None
    out: list[tuple[int, float]] = []
    with open(p, newline="") as f:
        reader = csv.DictReader(f)
        cols = [f"time_stats.{op}.median" for op in _VIDUR_LAYER_OPS] + ["time_stats.emb.median", "num_tokens", "num_tensor_parallel_workers"]
        missing = [c for c in cols if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{p}: not a Vidur MLP profile (missing columns {', '.join(missing)})")
        for i, row in enumerate(reader, start=2):
            try:
                if int(row["num_tensor_parallel_workers"]) != tp:
                    continue
                layer = sum(float(row[f"time_stats.{op}.median"]) for op in _VIDUR_LAYER_OPS)
                ms = _VIDUR_LAYERS * layer + float(row["time_stats.emb.median"])
                out.append((int(row["num_tokens"]), ms))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{p}: line {i}: {e}") from None
    out.sort()
    return out


def fit_line(points: list[tuple[int, float]], lo: int = 0, hi: int | None = None) -> LinearFit:
    """Least-squares line through the points with ``lo <= tokens <= hi``."""
    sel = [(float(n), t) for n, t in points if n >= lo and (hi is None or n <= hi)]
    if len(sel) < 2:
        raise ValueError(f"fewer than two points with {lo} <= num_tokens <= {hi}")
    k = len(sel)
    mx = sum(x for x, _ in sel) / k
    my = sum(y for _, y in sel) / k
    sxx = sum((x - mx) ** 2 for x, _ in sel)
    if sxx == 0:
        raise ValueError("every selected point has the same num_tokens")
    slope = sum((x - mx) * (y - my) for x, y in sel) / sxx
    return LinearFit(my - slope * mx, slope, k)


def fit_vidur_profile(path: str | os.PathLike[str] | None = None) -> VidurFit | None:
    """Fit the A100 prefill slope (TP1, num_tokens >= 1024) and decode floor (TP1,
    num_tokens <= 128) from the Vidur profile; None when the file is not found."""
    points = load_vidur_profile(path)
    if points is None:
        return None
    return VidurFit(prefill=fit_line(points, lo=1024), decode=fit_line(points, hi=128))
