"""Execution-time model of the encoder, shared by its load shedding and the tokenizer's admission control.

Pure Python (no torch, no Triton): tests/unit/test_shedding.py and tests/unit/test_admission.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CostModel:
    """Execution time of one batch: ``fixed_ms + ms_per_token x rows x padded length``, learned as moving averages.

    Attributes:
        ms_per_token: cost per padded token, ms (CPU, MiniLM: ~0.1; a GPU graph replay: far less). Learned from
            executions of at least ``min_tokens`` padded tokens, after taking ``fixed_ms`` off.
        fixed_ms: cost of an execution regardless of its size (call overhead, thread wake-up), ms. Learned from
            the smaller executions, after taking the per-token part off.
        alpha: weight of each new observation (0.1: about the last 10 executions of that kind).
        min_tokens: the boundary between "small" (teaches ``fixed_ms``) and "large" (teaches ``ms_per_token``).
        margin: factor on the estimate (measured: execution time / this model's estimate had p90 1.38 during a 4x
            overload on 2 CPU cores, where the server and its clients share the cores).
    """

    ms_per_token: float
    fixed_ms: float = 0.0
    alpha: float = 0.1
    min_tokens: int = 256
    margin: float = 1.4

    def typical_ms(self, rows: int, width: int) -> float:
        """Typical execution time of ``rows`` texts padded to ``width`` tokens, milliseconds (no margin)."""
        return self.fixed_ms + self.ms_per_token * rows * width

    def estimate_ms(self, rows: int, width: int) -> float:
        """Execution time of ``rows`` texts padded to ``width`` tokens to plan with, milliseconds (margin included)."""
        return self.margin * self.typical_ms(rows, width)

    def own_ms(self, rows: int, width: int) -> float:
        """A request's own share of an execution, ms (margin included): its tokens' cost, without ``fixed_ms``.

        Every execution pays ``fixed_ms`` once, whatever it holds, so it is no measure of a request's size. This is
        what "big by itself" is measured by (``shedding.py``): with the fixed part in, one short text on busy cores
        (fixed ~30 ms) counted as big against any budget under ~170 ms and was never refused.
        """
        return self.margin * self.ms_per_token * rows * width

    def observe(self, took_ms: float, rows: int, width: int) -> None:
        """Learn from one execution of ``rows`` x ``width`` padded tokens that took ``took_ms`` ms."""
        tokens = rows * width
        if tokens >= self.min_tokens:
            per_token = max(0.0, took_ms - self.fixed_ms) / tokens
            self.ms_per_token += self.alpha * (per_token - self.ms_per_token)
        else:
            fixed = max(0.0, took_ms - self.ms_per_token * tokens)
            self.fixed_ms += self.alpha * (fixed - self.fixed_ms)
