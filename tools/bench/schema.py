"""The bench report's schema (``cutile-kernels/bench/2``), as pydantic models.

``cutile-kernels bench --out DIR`` writes ``bench.json`` that validates against :class:`BenchReport`;
``python -m cutile_kernels_tools.bench.schema`` prints the JSON Schema (``docs/bench-schema.json`` holds
it; a test keeps the two in step). Times are milliseconds unless a name says ``us``
(microseconds); rates are per second; bandwidth in bytes/s; shares are fractions of 1.
"""

from __future__ import annotations

import json
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class Spread(_Model):
    median: float = Field(description="median of every sample of every round")
    min: float
    max: float
    n: int
    round_medians: Optional[list[float]] = Field(default=None, description="median of each timing round, in order")


class Correctness(_Model):
    max_abs_err: float = Field(description="max |logits - reference|")
    rel_l2_err: float = Field(description="||logits - reference|| / ||reference||")
    kl: float = Field(description="mean KL(softmax(reference) || softmax(logits)), nats")
    top5_agreement: float = Field(description="mean |top5 ∩ reference top5| / 5")


class Decode(_Model):
    batch: int
    ttft_ms: float = Field(description="prefill of the decode prompt: time to the first token (median over rounds)")
    ttft_round_ms: Optional[list[float]] = Field(default=None, description="time to the first token in each round")
    step_ms: Spread
    tokens_per_s: float


class KernelRow(_Model):
    kernel: str
    ours: bool
    count: int
    us: float = Field(description="device microseconds in the profiled window")
    share: float
    ops: list[str] = Field(description="aten ops that launched it, most time first")
    modules: list[str] = Field(description="modules it ran in (layer index folded to *)")
    ceiling: float = Field(description="Amdahl ceiling 1 / (1 - share + share / amdahl_speedup)")


class PhaseKernel(_Model):
    kernel: str
    op: str = Field(description="the aten op that launched it for the most time ('?' when unknown)")
    count: int
    us: float = Field(description="device microseconds in this phase")
    non_gemm_share: float = Field(description="us / the phase's non_gemm_us")


class PhaseShare(_Model):
    device_us: float
    launches: int
    non_gemm_us: float = Field(description="device microseconds outside GEMM kernels")
    ours_us: float
    ours_non_gemm_share: float = Field(description="ours_us / non_gemm_us")
    uncovered: list[PhaseKernel] = Field(
        default_factory=list, description="the phase's non-GEMM kernels not ours, most time first (reports before "
                                          "2026-12-04 have none)")


class Coverage(_Model):
    device_us: float
    launches: int
    ours_time_share: float
    ours_launch_share: float
    ours: list[KernelRow]
    uncovered: list[KernelRow]
    by_class: dict[str, float] = Field(description="device microseconds per kernel class")
    amdahl_speedup: float
    phases: Optional[dict[str, PhaseShare]] = Field(
        default=None, description="'prefill' and 'decode' (the decode steps together), profiled apart")


class Roofline(_Model):
    prefill_floor_ms: float = Field(description="2 x parameters x tokens / measured matmul rate")
    prefill_fraction: float
    decode: list[dict] = Field(description="per batch: bound (weights read once per step) and fraction")


class Runtime(_Model):
    launches: dict[str, int] = Field(description="prebuilt variant symbol -> launches")
    jit_launches: dict[str, int]
    fallbacks: dict[str, int] = Field(description="'kernel: reason' -> calls")
    reference_calls: dict[str, int]


class LoadToToken(_Model):
    load_s: float = Field(description="seconds from the start of from_pretrained (and any patching) until it returned")
    first_token_s: float = Field(description="seconds from the start of loading to the prefill's token (a fresh "
                                             "decode prompt, the first decode batch size)")
    decode_ready_s: float = Field(description="seconds from the start of loading to the token of the third decode "
                                              "step: compilation, CUDA-graph recording or capture included")
    batch: int


class PathResult(_Model):
    ok: bool
    error: Optional[str] = None
    path: Optional[str] = None
    description: Optional[str] = None
    correctness: Optional[Correctness] = None
    decode_correctness: Optional[dict[str, Correctness]] = Field(
        default=None, description="per decode batch size: its teacher-forced decode steps (the path's own cache and "
                                  "step) against a float32 forward over the same tokens (reports before 2026-12-06 "
                                  "have none)")
    kernelized_layers: Optional[dict[str, int]] = None
    inert_patches: Optional[list[str]] = Field(default=None, description="opt-in patches the path names that "
                                               "changed nothing in this model (on CUDA): its row is the base path's")
    weight_bytes: Optional[int] = None
    n_params: Optional[int] = None
    load_to_token: Optional[LoadToToken] = None
    prefill_ms: Optional[Spread] = None
    prefill_host_ms: Optional[Spread] = Field(default=None, description="host time of each timed prefill call: until "
                                              "the forward returned, before waiting for the GPU")
    prefill_host_cpu_ms: Optional[Spread] = Field(default=None, description="CPU time of the timing thread over "
                                                  "each prefill's host time: well below it, the thread waited")
    prefill_gc_ms: Optional[Spread] = Field(default=None, description="time in Python's garbage collector during "
                                            "each prefill's host time")
    prefill_tokens_per_s: Optional[float] = None
    decode: Optional[list[Decode]] = None
    runtime: Optional[Runtime] = None
    peak_memory_bytes: Optional[int] = None
    coverage: Optional[Coverage] = None
    roofline: Optional[Roofline] = None


class Limits(_Model):
    ok: bool
    device: str
    copy_bytes: int
    copy_bandwidth_Bps: float
    matmul_n: int
    matmul_dtype: str
    matmul_flops: float


class GateCheck(_Model):
    metric: str
    path: float
    stock: float
    passed: bool
    lost: Optional[int] = None
    won: Optional[int] = None


class Gate(_Model):
    passed: bool
    checks: list[GateCheck]


class BenchReport(_Model):
    schema_: str = Field(alias="schema")
    model: str
    checkpoint: str
    environment: dict
    settings: dict
    limits: Limits
    reference: dict = Field(description="the float32 reference job: model_type, vocab_size and (since 2026-12-06) "
                                        "decode_check_steps, the decode check's steps per batch size")
    paths: dict[str, PathResult]
    skipped: dict[str, str] = Field(description="path -> why it could not run here")
    gate: Optional[dict[str, Gate]] = Field(default=None, description="per path, against stock eager")
    speedup_by_round: Optional[dict[str, dict[str, list[float]]]] = Field(
        default=None, description="per path and figure (prefill, decode-b<N>), stock's round median over the path's, "
                                  "round by round")
    cutile_kernels_ran: bool
    note: Optional[str] = None
    ungated: Optional[str] = Field(default=None, description="why nothing was gated (no stock path), when so")


def json_schema() -> dict:
    return BenchReport.model_json_schema(by_alias=True)


if __name__ == "__main__":
    print(json.dumps(json_schema(), indent=1))
